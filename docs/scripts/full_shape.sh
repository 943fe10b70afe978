#!/usr/bin/env bash
# The full-shape measurements of docs/PERFORMANCE.md in device calls of <= 10 minutes, on a GPU that holds the
# flash q2 file (an H200): the random-weight file (with its MTP layer, for `draft`) in a tmpfs, then one part per
# call (chain the calls so the machine, and the file on it, stay warm between them; a part re-makes the file when
# it is missing).
#   bash docs/scripts/full_shape.sh bench [OLD_TREE]  engine bench of this tree (and of OLD_TREE, a `git archive`
#                                                     of an older commit, in the same call)
#   bash docs/scripts/full_shape.sh serve             `bench serve` with an 8K prompt (the user's path)
#   bash docs/scripts/full_shape.sh long              engine bench of a 128K prompt: prefill and decode after it
#                                                     (issue 20's 128K targets; ~4 minutes)
#   bash docs/scripts/full_shape.sh streams           1/2/4/8 concurrent greedy streams through serve (AHEAD=0: with
#                                                     DS4STATION_DECODE_AHEAD=0, decode ahead off)
#   bash docs/scripts/full_shape.sh onoff VAR         serve's decode after 8K with the switch VAR=1 and VAR=0 (e.g.
#                                                     DS4STATION_Q8_TMA, DS4STATION_DECODE_AHEAD), alternating twice
#   bash docs/scripts/full_shape.sh draft             verification steps and oracle / MTP drafts (issue 21)
#   bash docs/scripts/full_shape.sh cpu [N]           a CPU stage of the flash shape cut to N layers (default 8) on
#                                                     the host's cores (kernels/cpu.py; no GPU, no file needed)
#   bash docs/scripts/full_shape.sh sweep             decode attention tile variants (attention_decode_tiles.py
#                                                     --sweep; no file needed), kept in /tmp/attn_sweep.txt
#   bash docs/scripts/full_shape.sh tiles [SPEC]      decode after 8K with the dispatched attention tiles and with
#                                                     SPEC (default: the sweep's best), alternating twice
#   bash docs/scripts/full_shape.sh tma               the TMA Q8_0 matvec candidate (q8_0_tma.py): check, then its
#                                                     sweep against the dispatched kernel (no file needed)
# Env: FILE (default /mnt/x/flash-q2.gguf); LAYERS=N makes and uses the flash shape cut to its first N layers
# (make_layers.py; default FILE /mnt/x/fN.gguf) on a card that cannot hold all 43 (30 fit an 80 GB H100).
# PYTHONPATH must reach this tree's dependencies.
set -u
part=${1:?usage: full_shape.sh bench|serve|long|streams|onoff|draft|cpu|sweep|tiles|tma [OLD_TREE|VAR|N|SPEC]}
old=${2:-}
layers=${LAYERS:-}
file=${FILE:-/mnt/x/${layers:+f$layers.gguf}}
[ -n "$layers" ] || file=${FILE:-/mnt/x/flash-q2.gguf}
here=$(pwd)
deps=${PYTHONPATH:-}
if [ "$part" = cpu ]; then
  timeout 580 python3 docs/scripts/cpu_layers.py "${2:-8}" 64 2>&1 | tail -3
  exit
fi
if [ "$part" = tma ]; then
  timeout 60 python3 docs/scripts/q8_0_tma.py check 2>&1 | tail -4
  timeout 480 python3 docs/scripts/q8_0_tma.py bench 2>&1 | grep -v "^    (" | tail -70
  exit
fi
if [ "$part" = sweep ]; then
  timeout 150 python3 docs/scripts/attention_decode_tiles.py --sweep 2>&1 | tee /tmp/attn_sweep.txt | grep -v failed
  exit
fi
if [ ! -f "$file" ]; then
  mkdir -p "$(dirname "$file")"
  mountpoint -q "$(dirname "$file")" || mount -t tmpfs -o size=100g tmpfs "$(dirname "$file")"
  if [ -n "$layers" ]; then python3 docs/scripts/make_layers.py "$file" "$layers" 2>&1 | tail -1
  else python3 -m ds4station.cli make-model --preset flash --mtp --device cuda --out "$file" 2>&1 | tail -1; fi
fi
bench() {  # tree label
  echo "=== bench $2"
  (cd "$1" && PYTHONPATH="$1:$deps" python3 -m ds4station.cli bench --model "$file" --prompts 2048 \
    --prefills 2048,8192 --runs 1 2>&1 | grep -v Warning | tail -9)
}
case $part in
  bench) bench "$here" "new"; [ -n "$old" ] && bench "$(cd "$old" && pwd)" "old ($old)" ;;
  long) timeout 560 python3 -m ds4station.cli bench --model "$file" --prompts 131072 --prefills 131072 --runs 1 \
          2>&1 | grep -v Warning | tail -9 ;;
  serve) timeout 240 python3 -m ds4station.cli bench serve --model "$file" --no-engine-bench --prompt-tokens 8K \
           --decode-tokens 64 --runs 2 2>&1 | tail -9 ;;
  onoff) var=${2:?onoff needs the variable, e.g. DS4STATION_Q8_TMA}
         guard=240  # the first server compiles the kernels (~110 s to ready); the later ones find them cached
         for r in 1 2; do for a in 1 0; do
           echo "=== $var=$a"
           env "$var=$a" timeout $guard python3 -m ds4station.cli bench serve --model "$file" --no-engine-bench \
             --prompt-tokens 8K --decode-tokens 64 --runs 2 2>&1 | grep -E "decode after|decode steps|long request" | cut -c1-200
           guard=150
         done; done ;;
  streams) DS4STATION_DECODE_AHEAD=${AHEAD:-1} TESTS=streams TEMPERATURE=0 timeout 400 \
             python3 docs/scripts/batch_streams.py "$file" new --sessions 8 --ctx 40K 2>&1 | grep -E "steps|tok/s" \
             | cut -c1-220 ;;
  draft) timeout 300 python3 -m ds4station.cli bench draft --model "$file" --k 1,2,3 --prompt-tokens 512 \
           --decode-tokens 32 2>&1 | tail -8 ;;
  tiles) spec=${2:-$(python3 docs/scripts/bench_attention_tiles.py --pick /tmp/attn_sweep.txt)}
         [ -n "$spec" ] || { echo "the dispatched tiles won the sweep"; exit 0; }
         for r in 1 2; do for a in "" "$spec"; do
           ATTN="$a" timeout 90 python3 docs/scripts/bench_attention_tiles.py bench --model "$file" --prompts 8192 \
             --prefills "" --runs 3 2>&1 | grep -E "tiles|decode after"
         done; done ;;
  *) echo "unknown part $part" >&2; exit 2 ;;
esac
