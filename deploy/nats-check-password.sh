# Run before NATS starts (compose's nats-password-check, the init container of
# kubernetes/nats.yaml, whose ConfigMap kvhint-nats-check holds the same text), with the
# password NATS will require in NATS_PASSWORD. Exits non-zero, and NATS does not start,
# while the password is empty or starts with the public placeholder prefix below (case
# ignored): the router and the plugin refuse such a password too (schemas/nats_address.py,
# PLACEHOLDER_SECRET_PREFIX: the same prefix, a test checks). The message never shows
# the password.
# POSIX sh and busybox: no bash.
LC_ALL=C
export LC_ALL
prefix=change-me
where="KVHINT_NATS_PASSWORD (compose: the shell or deploy/.env) or the Secret kvhint-nats (Kubernetes)"
if [ -z "${NATS_PASSWORD:-}" ]; then
  echo "kvhint: refusing to start NATS: its password is empty; set $where" >&2
  exit 1
fi
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
