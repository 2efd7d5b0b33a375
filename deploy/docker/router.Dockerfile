# The kvhint router: `kvhint router --config /etc/kvhint/router.yaml`.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas schemas
COPY router router
COPY engine_plugin engine_plugin
COPY migrations migrations
RUN pip install --no-cache-dir '.[router]'
# Tokenizers for vLLM-compatible block hashes: mount the model folder (or set
# KVHINT_ROUTER_TOKENIZER to a hub id the pod can reach).
EXPOSE 8080
ENTRYPOINT ["kvhint", "router"]
CMD ["--config", "/etc/kvhint/router.yaml", "--host", "0.0.0.0"]
