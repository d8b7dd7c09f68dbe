# Sourced by the tests_gpt scripts: the switches they share, parsed from "$@".
#   --shape_order SBH|BSH   activation layout the attention op sees (MEGATRON_ADAPT_ATTENTION_LAYOUT)
#   --pre N / --next N      kept in PRE / NEXT for the caller
#   anything else           appended to EXTRA (passed to Megatron as is)
# Also picks a free MASTER_PORT unless one is set. The caller's name is in $0 for messages.
SHAPE_ORDER=SBH; PRE=""; NEXT=""; EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --shape_order=*|--shape-order=*) SHAPE_ORDER="${1#*=}" ;;
        --shape_order|--shape-order) SHAPE_ORDER="${2:?--shape_order needs SBH or BSH}"; shift ;;
        --pre=*) PRE="${1#*=}" ;;
        --pre) PRE="${2:?--pre needs N}"; shift ;;
        --next=*) NEXT="${1#*=}" ;;
        --next) NEXT="${2:?--next needs N}"; shift ;;
        *) EXTRA+=("$1") ;;
    esac
    shift
done

case "${SHAPE_ORDER^^}" in
    SBH) export MEGATRON_ADAPT_ATTENTION_LAYOUT=sbhd ;;
    BSH) export MEGATRON_ADAPT_ATTENTION_LAYOUT=bshd ;;
    *) echo "$(basename "$0"): --shape_order must be SBH or BSH, got '$SHAPE_ORDER'" >&2; exit 2 ;;
esac

if [[ -z "${MASTER_PORT:-}" ]]; then
    MASTER_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
