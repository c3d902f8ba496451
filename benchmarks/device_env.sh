# Sourced by the device scripts: install the carried wheels (DeepSpeed, the benchmark peer) and
# print what the results depend on (GPUs, RAM, the scratch disk).
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c
free -g | head -2
df -h /tmp | tail -1
