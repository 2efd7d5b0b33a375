# Starts one of NATS's clients (the router, a vLLM worker with the plugin) with NATS's URL
# in an environment variable: user kvhint and the password in KVHINT_NATS_PASSWORD,
# percent-encoded, before the server given:
#   sh nats-url-env.sh VARIABLE nats://HOST:PORT COMMAND [ARG...]
# compose.yaml runs the router and the workers through it (mounted at
# /etc/kvhint-nats/nats-url-env.sh), and so do kubernetes/router.yaml and
# kubernetes/vllm-workers.yaml (the ConfigMap kvhint-nats-client in kubernetes/nats.yaml
# holds the same text). Every byte of the password is written %XX, which the router and
# the plugin decode (schemas/nats_address.py): any password works, "/", "#", "?", "@",
# "%" and "," included, which written as they are would end the URL's user info early
# or split its server list. Neither the password nor the URL is ever on a command line
# (ps shows those) nor printed.
# POSIX sh and busybox: no bash.
set -eu
if [ "$#" -lt 3 ]; then
  echo "kvhint: usage: sh nats-url-env.sh VARIABLE nats://HOST:PORT COMMAND [ARG...]" >&2
  exit 2
fi
variable=$1
server=$2
shift 2
case $variable in
  '' | [0-9]* | *[!A-Za-z0-9_]*)
    echo "kvhint: '$variable' is not an environment variable's name" >&2
    exit 2
    ;;
esac
case $server in
  *@* | *,* | *[!A-Za-z0-9:/._-]*)
    echo "kvhint: give one server without credentials, e.g. nats://nats:4222" >&2
    exit 2
    ;;
  *://*) ;;
  *)
    echo "kvhint: give the server as a URL, e.g. nats://nats:4222" >&2
    exit 2
    ;;
esac
if [ -z "${KVHINT_NATS_PASSWORD:-}" ]; then
  echo "kvhint: NATS's password is empty; set KVHINT_NATS_PASSWORD (compose: the shell" \
    "or deploy/.env) or the Secret kvhint-nats (Kubernetes)" >&2
  exit 1
fi
encoded=$(printf '%s' "$KVHINT_NATS_PASSWORD" | od -An -v -tx1 | tr -d ' \n' | sed 's/../%&/g')
if [ -z "$encoded" ]; then
  echo "kvhint: could not percent-encode NATS's password (od, tr and sed are needed)" >&2
  exit 1
fi
export "$variable=${server%%://*}://kvhint:$encoded@${server#*://}"
exec "$@"
