# A vLLM worker with the kvhint engine plugin (a KV connector) installed next to vLLM.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
COPY pyproject.toml README.md /src/
COPY schemas /src/schemas
COPY router /src/router
COPY engine_plugin /src/engine_plugin
COPY migrations /src/migrations
RUN pip install --no-cache-dir '/src[engine]'
