#!/usr/bin/env bash
# Copy the peer of kernels/bench_fused_moe_fp8.py, SGLang's Triton fused MoE (block-FP8 W8A8
# mode), out of a git checkout or bare mirror of sgl-project/sglang into .peer/sglang/, which git
# ignores: the peer's code is never committed here, it is copied at run time and carried to the
# GPU machine with the run (carry: .peer). kernels/peer_sglang.py loads it.
#
# Copied (with `git show`, nothing else is read), a few hundred KB:
#   - the Triton fused-MoE kernel file (fused_moe_triton_kernels.py, or fused_moe.py in versions
#     that kept `fused_moe_kernel` there) and, to read the launch path peer_sglang.py mirrors,
#     fused_moe.py, fused_moe_triton_config.py and moe_align_block_size.py where they exist;
#   - python/sglang/srt/layers/quantization/fp8_kernel.py (the Triton activation quantizer);
#   - every tuned table of the block-FP8 mode, `configs/triton_*/...dtype=fp8_w8a8,
#     block_shape=[128, 128]*.json` (peer_sglang.py picks one by E, N, device and Triton version
#     as SGLang does);
#   - SGLang's LICENSE (Apache-2.0).
# COMMIT holds the commit copied; MANIFEST the source paths, sizes and the mirror.
#
#   usage: kernels/fetch_peer_sglang.sh MIRROR_GIT_DIR [REV (default HEAD)]
#   e.g.   kernels/fetch_peer_sglang.sh /work/.mirror/sgl-project+sglang/repo
set -euo pipefail

git_dir=${1:?usage: kernels/fetch_peer_sglang.sh MIRROR_GIT_DIR [REV]}
rev=${2:-HEAD}
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$root/.peer/sglang

g() { git --git-dir="$git_dir" "$@"; }
commit=$(g rev-parse --verify "$rev^{commit}")
has() { g cat-file -e "$commit:$1" 2>/dev/null; }

# Where the Triton MoE runner lives: moved from layers/moe/fused_moe_triton/ to
# layers/moe/moe_runner/triton_utils/ in 2026.
moe_dir=
for d in python/sglang/srt/layers/moe/moe_runner/triton_utils \
  python/sglang/srt/layers/moe/fused_moe_triton; do
  if has "$d/fused_moe_triton_kernels.py" || has "$d/fused_moe.py"; then
    moe_dir=$d
    break
  fi
done
[ -n "$moe_dir" ] || { echo "no Triton fused-MoE directory at $commit" >&2; exit 1; }
quant=python/sglang/srt/layers/quantization/fp8_kernel.py
has "$quant" || { echo "no $quant at $commit" >&2; exit 1; }

tmp=$dest.tmp
rm -rf "$tmp"
mkdir -p "$tmp/configs"
manifest=$tmp/MANIFEST
{
  echo "sglang commit $commit ($(g log -1 --format='%cs %s' "$commit"))"
  echo "mirror $git_dir"
  echo "copied $(date -u +%FT%TZ) by kernels/fetch_peer_sglang.sh"
  echo "bytes  source -> copy (under .peer/sglang/)"
} >"$manifest"

copy() {  # copy SOURCE_PATH DEST_RELATIVE
  g show "$commit:$1" >"$tmp/$2"
  printf '%6d %s -> %s\n' "$(wc -c <"$tmp/$2")" "$1" "$2" >>"$manifest"
}

for f in fused_moe_triton_kernels.py fused_moe.py fused_moe_triton_config.py \
  moe_align_block_size.py; do
  if has "$moe_dir/$f"; then copy "$moe_dir/$f" "$f"; fi
done
copy "$quant" fp8_kernel.py
if has LICENSE; then copy LICENSE LICENSE; fi

n_tables=0
while IFS= read -r path; do
  rel=${path#"$moe_dir/configs/"}
  mkdir -p "$tmp/configs/$(dirname "$rel")"
  copy "$path" "configs/$rel"
  n_tables=$((n_tables + 1))
done < <(g ls-tree -r --name-only "$commit" -- "$moe_dir/configs/" |
  grep -F 'dtype=fp8_w8a8,block_shape=[128, 128]' | grep '\.json$' || true)

echo "$commit" >"$tmp/COMMIT"
rm -rf "$dest"
mv "$tmp" "$dest"
bytes=$(du -sb "$dest" | cut -f1)
echo "sglang $commit: $(grep -c ' -> ' "$dest/MANIFEST") files ($n_tables block-FP8 tables)," \
  "$bytes bytes in $dest"
if [ "$bytes" -gt $((4 * 1024 * 1024)) ]; then
  echo "warning: the copy is over 4 MiB" >&2
fi
