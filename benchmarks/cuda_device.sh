#!/usr/bin/env bash
# Issue 29's GPU checks on a lent GPU machine (docs/benchmarks.md, "GPU target"), run from the repository.
# The machine reaches no package index, so what it lacks travels in PIECES, over as many calls as the
# device tool's 64 MiB per call take (each call copies its share into PIECES):
#   ort.*  onnxruntime-gpu's package folder as one tar.xz, split (cat ort.* | xz -d | tar x);
#   *.whl  wheels installed with --no-deps (transformers, gguf; onnxruntime-genai-cuda for --genai);
#   SmolLM2-135M-Instruct.Q4_1.gguf.xz, for the SmolLM2 steps only.
# STEPS (default "kernel report gpu"):
#   kernel  builds mxspd's MXFP6 CUDA kernel with the machine's nvcc (python -m kernels.cuda_build; and the CPU
#           kernels' library, for its reference), checks it against that reference and times it against
#           float16 MatMul and 8-bit MatMulNBits at Llama-2-7B MLP shapes (python -m benchmarks.gpu_kernel).
#           Run it first: the ort-cuda builds of the later steps lower MX weights to this kernel.
#   bg7b    copies the repository to /root/src and starts building the 7B-shaped recipe's two artifacts
#           (llama2-7b-spd's widths with LAYERS decoder layers, default 2, and the llama-160m draft;
#           random weights) in the background, with the machine's CPU ONNX Runtime: the wheels are
#           enough, and the build overlaps the calls that bring onnxruntime-gpu. Graph costs are then
#           not timed at build (no CUDA provider yet): the runtime's policies measure them as they go.
#   bgwide  likewise starts, in the background, SmolLM2 widened 8x to a 7B's cost (python -m
#           benchmarks.widen_checkpoint: 7.25B parameters, 14.5 GB in float16, the same text as SmolLM2) and
#           the builds of its Figure-7 report (SmolLM2 itself as the draft), one at a time (disk: 64 GiB);
#   wide    waits for those, then that report twice (issue 59's "Figure 7 at 7B cost");
#   7b      waits for those builds, then the Figure-7 report on them twice and benchmarks.gpu on both;
#   memory  waits for those builds, then benchmarks.gpu_memory on both (shared weights against a copy per session);
#   report  the Figure-7 report on smollm2-135m-chat twice;   draft  the same on tiny-stdlib-spd;
#   gpu     benchmarks.gpu on smollm2-135m-chat (float16 and MXFP6; onnxruntime-genai-cuda if its wheel came).
# Logs and reports go to OUT (at most 8 files come back from the device tool).
set -uo pipefail
P=${PIECES:?} OUT=${OUT:?}
SITE=/tmp/site ORTGPU=/tmp/ortgpu SRC=/root/src CK=/root/ck R7=/root/rep7 WIDE=/root/wide RW=/root/repw
has() { [[ " ${STEPS:-kernel report gpu} " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
summarize() {  # benchmarks.gpu's JSON, the figures docs/benchmarks.md quotes
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(r["gpu"], r["read_bandwidth_GB_per_s"], "GB/s")
for a, v in r["artifacts"].items():
    print(a, v["weights_read_per_token_MB"], "MB/token, floor", v["floor_tokens_per_s"], "same", v["same_tokens"],
          "device argmax", v.get("device_argmax"))
    print("   calls, ms:", v["call_pattern_ms"])
    for mode in ("cuda_graph", "launches"):
        rows = v[mode]
        print("  ", mode, rows if isinstance(rows, str) else [(x["decode_tokens_per_s"], x["call_ms_per_token"],
              x["host_ms_per_token"], x["spd_equals_ar"]) for x in rows])
print(json.dumps(r.get("genai"), indent=1))
PY
}
mkdir -p $SITE
if compgen -G "$P/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $SITE $P/*.whl 2>&1 | grep -v WARN
fi
REPORT7=(python3 -m benchmarks.report --recipe llama2-7b-spd --target ort-cuda --tlm $CK/tlm --dlm $CK/dlm
         --max-new-tokens "${NEW7:-64}" --out $R7 --bandwidth-gib 4)

GGUF=/root/SmolLM2-135M-Instruct.Q4_1.gguf
REPORTW=(python3 -m benchmarks.report --recipe smollm2-135m-chat --target ort-cuda --tlm $WIDE --dlm $GGUF
         --max-new-tokens "${NEWW:-64}" --out $RW --bandwidth-gib 4)
if has bg7b || has bgwide; then
  rm -rf $SRC && cp -a . $SRC && cd $SRC || exit 1
  if has bg7b; then
    PYTHONPATH=$SITE:$SRC setsid nohup bash -c "
      python3 -m benchmarks.make_checkpoint --shape llama2-7b --layers ${LAYERS:-2} --out $CK/tlm > /root/ck_tlm.log 2>&1 &
      python3 -m benchmarks.make_checkpoint --shape llama-160m --out $CK/dlm > /root/ck_dlm.log 2>&1 &
      wait; echo checkpoints at \$(date +%T); ${REPORT7[*]} --parallel-builds; echo builds done at \$(date +%T)
    " > /root/bg7b.log 2>&1 < /dev/null &
    echo $! > /root/bg7b.pid
    echo "started the 7B-shaped builds in the background at $(date +%T)"
  fi
  if has bgwide; then  # one build at a time: a 7.25B float16 artifact, its MXFP6 one and an export's scratch
    [ -f $GGUF ] || xz -dc $P/SmolLM2-135M-Instruct.Q4_1.gguf.xz > $GGUF || exit 1
    PYTHONPATH=$SITE:$SRC setsid nohup bash -c "
      python3 -m benchmarks.widen_checkpoint --source $GGUF --r 8 --dtype float16 --out $WIDE; echo widened at \$(date +%T)
      ${REPORTW[*]}; echo builds done at \$(date +%T)
    " > /root/bgwide.log 2>&1 < /dev/null &
    echo $! > /root/bgwide.pid
    echo "started widening SmolLM2 to a 7B's cost and its builds in the background at $(date +%T)"
  fi
  exit 0
fi

# onnxruntime-gpu, ahead of the machine's CPU onnxruntime on the path; pip's CUDA libraries found by the loader
if [ ! -d $ORTGPU/onnxruntime ]; then
  mkdir -p $ORTGPU && cat $P/ort.* | xz -d | tar xf - -C $ORTGPU || exit 1
fi
SP=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LD_LIBRARY_PATH=$(find "$SP/nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u | paste -sd:)
export LD_LIBRARY_PATH PYTHONPATH=$ORTGPU:$SITE:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import onnxruntime as o, transformers, torch; print('ort', o.__version__, o.get_available_providers(),
'transformers', transformers.__version__, 'torch', torch.__version__)"

if has kernel; then
  SECONDS=0
  [ -n "$(python3 -c 'import kernels; print(kernels.library_path() or "")')" ] \
    || python3 setup.py -q build_ext --inplace > $OUT/cpu_build.log 2>&1
  python3 -m kernels.cuda_build > $OUT/cuda_build.log 2>&1
  echo "kernel builds: rc $? in ${SECONDS}s"; tail -n 5 $OUT/cuda_build.log
  timeout "${KERNEL_S:-180}" python3 -m benchmarks.gpu_kernel --out $OUT/kernel.json > $OUT/kernel.log 2>&1
  echo "gpu_kernel: rc $? in ${SECONDS}s"; tail -n 60 $OUT/kernel.log
fi
wait_for() {  # a background job (bg7b, bgwide) to end; still building, a report would start a second build
  SECONDS=0
  timeout "${BUILD_WAIT_S:-300}" bash -c "while kill -0 \$(cat /root/$1.pid) 2> /dev/null; do sleep 1; done"
  local waited=$?
  echo "waited ${SECONDS}s for $1"; cp /root/$1.log $OUT/$1.log; tail -n 2 /root/$1.log
  [ $waited -eq 0 ] || { echo "$1 is still running"; exit 1; }
}
if has 7b || has memory || has wide; then
  cd $SRC || exit 1
  export PYTHONPATH=$ORTGPU:$SITE:$SRC
  { has 7b || has memory; } && wait_for bg7b
  has wide && wait_for bgwide
fi
if has wide; then  # Figure 7 at a 7B's cost: SmolLM2 widened 8x (7.25B parameters, its own text), SmolLM2 as the draft
  for i in 1 2; do
    SECONDS=0
    timeout "${REPORTW_S:-300}" "${REPORTW[@]}" > $OUT/rw_$i.log 2>&1
    echo "widened SmolLM2 report $i: rc $? in ${SECONDS}s"
    cp $RW/smollm2-135m-chat/report.json $OUT/rw_$i.json
    sed -n '/^|/p' $RW/smollm2-135m-chat/report.md
  done
fi
if has memory; then  # one device copy of each model's weights for all its graphs, against a copy per session
  for a in fp32 mxfp6; do
    timeout "${MEMORY_S:-80}" python3 -m benchmarks.gpu_memory $R7/llama2-7b-spd/$a > $OUT/memory_$a.json 2> $OUT/memory_$a.log
    echo "memory $a: rc $?"; cat $OUT/memory_$a.json; tail -n 2 $OUT/memory_$a.log
  done
fi
if has 7b; then
  for i in 1 2; do
    SECONDS=0
    timeout "${REPORT7_S:-240}" "${REPORT7[@]}" > $OUT/r7_$i.log 2>&1
    echo "7B-shaped report $i: rc $? in ${SECONDS}s"
    cp $R7/llama2-7b-spd/report.json $OUT/r7_$i.json
    sed -n '/^|/p' $R7/llama2-7b-spd/report.md
  done
  SECONDS=0
  timeout "${GPU7_S:-150}" python3 -m benchmarks.gpu $R7/llama2-7b-spd/fp32 $R7/llama2-7b-spd/mxfp6 --rounds 2 \
    --new-tokens "${NEW7:-64}" > $OUT/gpu7.json 2> $OUT/gpu7.log
  echo "gpu: rc $? in ${SECONDS}s"; tail -n 3 $OUT/gpu7.log
  summarize $OUT/gpu7.json
fi

if has report || has gpu; then
  [ -f $GGUF ] || xz -dc $P/SmolLM2-135M-Instruct.Q4_1.gguf.xz > $GGUF || exit 1
fi
REP=/root/rep/smollm2-135m-chat
GENAI=$(compgen -G "$P/onnxruntime_genai*.whl" > /dev/null && echo fp16,int4)
if has report; then
  for i in 1 2; do
    SECONDS=0
    timeout "${REPORT_S:-300}" python3 -m benchmarks.report --recipe smollm2-135m-chat --target ort-cuda --tlm $GGUF \
      --out /root/rep --bandwidth-gib 4 > $OUT/report$i.log 2>&1
    echo "report $i: rc $? in ${SECONDS}s"
    cp $REP/report.md $OUT/report$i.md; cp $REP/report.json $OUT/report$i.json
  done
fi
if has draft; then
  for i in 1 2; do
    SECONDS=0
    timeout "${REPORT_S:-300}" python3 -m benchmarks.report --recipe tiny-stdlib-spd --target ort-cuda --out /root/rep \
      --bandwidth-gib 4 > $OUT/draft$i.log 2>&1
    echo "draft report $i: rc $? in ${SECONDS}s"
    cp /root/rep/tiny-stdlib-spd/report.md $OUT/draft$i.md; cp /root/rep/tiny-stdlib-spd/report.json $OUT/draft$i.json
  done
fi
if has gpu; then
  SECONDS=0
  [ -d $REP/mxfp6 ] || python3 -m export --recipe smollm2-135m-chat --tlm $GGUF --target ort-cuda --out $REP/mxfp6 \
    --quiet > $OUT/export_mxfp6.log 2>&1 &
  [ -d $REP/fp32 ] || python3 -m export --recipe smollm2-135m-chat --tlm $GGUF --target ort-cuda --mx-format none \
    --out $REP/fp32 --quiet > $OUT/export_fp16.log 2>&1 &
  [ -n "$GENAI" ] && python3 -c "from benchmarks.peers import Genai
for p in '$GENAI'.split(','): Genai(__import__('pathlib').Path('$GGUF'), p, 1, provider='cuda')" > $OUT/genai_build.log 2>&1 &
  wait
  echo "builds: ${SECONDS}s"
  timeout "${GPU_S:-300}" python3 -m benchmarks.gpu $REP/fp32 $REP/mxfp6 --rounds 2 ${GENAI:+--genai $GENAI --gguf $GGUF} \
    > $OUT/gpu.json 2> $OUT/gpu.log
  echo "gpu: rc $? in ${SECONDS}s"
  tail -n 3 $OUT/*.log
  summarize $OUT/gpu.json
fi
