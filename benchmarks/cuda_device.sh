#!/usr/bin/env bash
# Issue 29's GPU checks in one run on a lent GPU machine (docs/benchmarks.md, "GPU target"): installs the
# carried onnxruntime-gpu, builds the SmolLM2 recipe for ort-cuda (float16 and MXFP6) and measures
# STEPS (default "report gpu"): `report`, the Figure-7 report twice; `gpu`, benchmarks.gpu (CUDA graphs on
# and off, host overhead, the floor, what a call costs after which other call, and onnxruntime-genai-cuda's
# fp16 and int4 builds if its wheel came); `draft`, the Figure-7 report twice on tiny-stdlib-spd, whose
# draft model ships in the repository (draft-model speculation on the GPU).
# PIECES holds piece.* (one tar, split to fit the device tool's transfers) of: ortgpu.tar.xz and
# libort.tar.xz (onnxruntime-gpu's package folder), wheels (gguf, transformers, onnxruntime-genai-cuda)
# and SmolLM2-135M-Instruct.Q4_1.gguf.xz. Logs and reports go to OUT.
set -uo pipefail
P=${PIECES:?} OUT=${OUT:?}
B=/root/bundle SITE=/tmp/site
if [ ! -d $B ]; then mkdir -p $B; cat $P/piece.* | tee >(md5sum >&2) | tar xf - -C $B || exit 1; fi
python3 - <<'PY' || exit 1
import lzma, pathlib, shutil, tarfile
b, site = pathlib.Path("/root/bundle"), pathlib.Path("/tmp/site")
gguf = b / "SmolLM2-135M-Instruct.Q4_1.gguf"
if not gguf.exists():
    with lzma.open(f"{gguf}.xz") as src, open(gguf, "wb") as dst:
        shutil.copyfileobj(src, dst)
for t in b.glob("*.tar.xz"):
    tarfile.open(t).extractall(site)
PY
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE $B/*.whl 2>&1 | grep -v WARN
SP=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LD_LIBRARY_PATH=$(find "$SP/nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:)
export LD_LIBRARY_PATH PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import onnxruntime as o, transformers, torch; print('ort', o.__version__, o.get_available_providers(),
'transformers', transformers.__version__, 'torch', torch.__version__)"
GGUF=$B/SmolLM2-135M-Instruct.Q4_1.gguf
REP=/root/rep/smollm2-135m-chat
GENAI=$(ls $B | grep -q onnxruntime_genai && echo fp16,int4)
if [[ " ${STEPS:-report gpu} " == *" report "* ]]; then
  for i in 1 2; do
    SECONDS=0
    timeout ${REPORT_S:-300} python3 -m benchmarks.report --recipe smollm2-135m-chat --target ort-cuda --tlm $GGUF \
      --out /root/rep --bandwidth-gib 4 > $OUT/report$i.log 2>&1
    echo "report $i: rc $? in ${SECONDS}s"
    cp $REP/report.md $OUT/report$i.md; cp $REP/report.json $OUT/report$i.json
  done
fi
if [[ " ${STEPS:-report gpu} " == *" draft "* ]]; then
  for i in 1 2; do
    SECONDS=0
    timeout ${REPORT_S:-300} python3 -m benchmarks.report --recipe tiny-stdlib-spd --target ort-cuda --out /root/rep \
      --bandwidth-gib 4 > $OUT/draft$i.log 2>&1
    echo "draft report $i: rc $? in ${SECONDS}s"
    cp /root/rep/tiny-stdlib-spd/report.md $OUT/draft$i.md; cp /root/rep/tiny-stdlib-spd/report.json $OUT/draft$i.json
  done
fi
if [[ " ${STEPS:-report gpu} " == *" gpu "* ]]; then
  SECONDS=0
  [ -d $REP/mxfp6 ] || python3 -m export --recipe smollm2-135m-chat --tlm $GGUF --target ort-cuda --out $REP/mxfp6 \
    --quiet > $OUT/export_mxfp6.log 2>&1 &
  [ -d $REP/fp32 ] || python3 -m export --recipe smollm2-135m-chat --tlm $GGUF --target ort-cuda --mx-format none \
    --out $REP/fp32 --quiet > $OUT/export_fp16.log 2>&1 &
  [ -n "$GENAI" ] && python3 -c "from benchmarks.vs_llamacpp import Genai
for p in '$GENAI'.split(','): Genai(__import__('pathlib').Path('$GGUF'), p, 1, provider='cuda')" > $OUT/genai_build.log 2>&1 &
  wait
  echo "builds: ${SECONDS}s"
  timeout ${GPU_S:-300} python3 -m benchmarks.gpu $REP/fp32 $REP/mxfp6 --rounds 2 ${GENAI:+--genai $GENAI --gguf $GGUF} \
    > $OUT/gpu.json 2> $OUT/gpu.log
  echo "gpu: rc $? in ${SECONDS}s"
  tail -n 3 $OUT/*.log
  python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/gpu.json"))
print(r["gpu"], r["read_bandwidth_GB_per_s"], "GB/s")
for a, v in r["artifacts"].items():
    print(a, v["weights_read_per_token_MB"], "MB/token, floor", v["floor_tokens_per_s"], "same", v["same_tokens"])
    print("   calls, ms:", v["call_pattern_ms"])
    for mode in ("cuda_graph", "launches"):
        rows = v[mode]
        print("  ", mode, rows if isinstance(rows, str) else [(x["decode_tokens_per_s"], x["call_ms_per_token"],
              x["host_ms_per_token"], x["spd_equals_ar"]) for x in rows])
print(json.dumps(r.get("genai"), indent=1))
PY
fi
