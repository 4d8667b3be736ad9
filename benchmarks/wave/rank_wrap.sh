#!/bin/bash
# Per-rank wrapper for run.sh: sets pocl's kernel cache dir for this rank.
#   WAVE_POCL=own    -> $WAVE_BASE/pocl/rank-$PMI_RANK (one dir per rank)
#   WAVE_POCL=shared -> $WAVE_BASE/pocl/shared          (one dir for all ranks)
set -e
rank=${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}}
case "$WAVE_POCL" in
  own)    export POCL_CACHE_DIR="$WAVE_BASE/pocl/rank-$rank" ;;
  shared) export POCL_CACHE_DIR="$WAVE_BASE/pocl/shared" ;;
  *) echo "rank_wrap.sh: bad WAVE_POCL=$WAVE_POCL" >&2; exit 2 ;;
esac
mkdir -p "$POCL_CACHE_DIR"
exec "$@"
