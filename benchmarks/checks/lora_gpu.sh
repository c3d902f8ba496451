#!/usr/bin/env bash
# Issue 51's first GPU check (nvidia-h200 or nvidia-h100-x1), one call, as a user types it: a
# Llama-shaped Hugging Face folder (random weights, saved by transformers, ~1.3 B: hidden 2048, 16
# layers) fine-tuned by `fitgpt train --init-from --lora-rank 16` on the GPU (bf16, the ddp engine
# the adapters take), beside a full fine-tune of the same folder and batch; the adapters exported
# (`fitgpt export --format peft`) and loaded by peft (carried wheel) on the GPU, its loss on one
# batch against transformers' on fitgpt's merged export (`--format hf --merge`).
# Usage (device): source benchmarks/device_env.sh; OUT=$OUT bash benchmarks/checks/lora_gpu.sh
set -u
OUT=${OUT:-/tmp/lora_gpu}
W=/tmp/lora_work
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
python3 - "$W/hf" <<'PY'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                  tie_word_embeddings=False)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
PY
COMMON=(--data synthetic --micro-batch 4 --grad-accum 2 --seq-len 2048 --steps 8 --log-every 1
  --eval-every 0 --precision bf16 --lr 1e-4 --warmup 1 --seed 3)
for kind in lora full; do
  extra=(); [ $kind = lora ] && extra=(--lora-rank 16)
  python3 -m fitgpt train --init-from "$W/hf" "${COMMON[@]}" "${extra[@]}" --out "$W/$kind" \
    --overwrite > "$OUT/train_$kind.log" 2>&1; echo "$kind: rc $?"
  grep -E "plan|placement|model |step +[0-9]+ \|" "$OUT/train_$kind.log" | tail -4
  cp "$W/$kind/metrics.jsonl" "$OUT/train_$kind.metrics.jsonl" 2>/dev/null
done
python3 -m fitgpt export --ckpt "$W/lora" --format peft --out "$W/peft" > "$OUT/export.log" 2>&1
echo "export: rc $?"; tail -1 "$OUT/export.log"
python3 -m fitgpt export --ckpt "$W/lora" --format hf --merge --out "$W/merged" \
  > "$OUT/export_merged.log" 2>&1; echo "export --merge: rc $?"; tail -1 "$OUT/export_merged.log"
python3 - "$W/hf" "$W/peft" "$W/merged" <<'PY' 2>&1 | tail -2 | tee "$OUT/peft_loss.json"
import json, sys, torch
from peft import PeftModel
from transformers import LlamaForCausalLM
hf, adapter, merged = sys.argv[1:4]
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 32000, (2, 512), generator=g).cuda()
with torch.no_grad():
    peft = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).cuda(), adapter).eval()
    theirs = float(peft(input_ids=ids, labels=ids).loss)
    del peft
    ours = float(LlamaForCausalLM.from_pretrained(merged, dtype=torch.float32).cuda().eval()(input_ids=ids, labels=ids).loss)
print(json.dumps({"peft_loss_on_fitgpt_adapter": theirs, "merged_export_loss": ours, "diff": abs(theirs - ours)}))
PY
