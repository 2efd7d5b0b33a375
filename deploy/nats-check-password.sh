# Run before NATS starts, with the password NATS will require in NATS_PASSWORD: compose's
# NATS runs it as its entrypoint, with nats-server's command line as arguments, which it
# execs once the check passed (no one-shot service exits, so `docker compose up
# --abort-on-container-exit` keeps the stack up); the init container of
# kubernetes/nats.yaml (whose ConfigMap kvhint-nats-check holds the same text) runs it
# without arguments: it checks and exits. Exits non-zero, and NATS does not start, while
# the password is empty, holds a double quote or a backslash (nats.conf cannot take
# them), or starts with the public placeholder prefix below (case ignored; the router
# and the plugin refuse that too: schemas/nats_address.py, PLACEHOLDER_SECRET_PREFIX,
# the same prefix, a test checks). The message never shows the password.
# POSIX sh and busybox: no bash.
LC_ALL=C
export LC_ALL
prefix=change-me
where="KVHINT_NATS_PASSWORD (compose: the shell or deploy/.env) or the Secret kvhint-nats (Kubernetes)"
if [ -z "${NATS_PASSWORD:-}" ]; then
  echo "kvhint: refusing to start NATS: its password is empty; set $where" >&2
  exit 1
fi
# nats.conf reads the password in double quotes: there a '"' ends it and a backslash
# starts an escape (\t is a tab), so NATS would refuse to start, or take another password.
case "$NATS_PASSWORD" in
  *'"'* | *\\*)
    echo "kvhint: refusing to start NATS: its password holds a double quote or a" \
      "backslash, which nats.conf cannot take as they are; replace it in $where" >&2
    exit 1
    ;;
esac
lower=$(printf '%s' "$NATS_PASSWORD" | tr 'A-Z' 'a-z')
case "$lower" in
  "$prefix"*)
    echo "kvhint: refusing to start NATS: its password is the public placeholder" \
      "($prefix...) shipped in deploy/; replace it in $where, e.g. with" \
      "python3 -c 'import secrets; print(secrets.token_urlsafe(24))'" >&2
    exit 1
    ;;
esac
echo "kvhint: the NATS password is set and not a placeholder"
[ "$#" -eq 0 ] || exec "$@"
