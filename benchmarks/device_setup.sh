# Sourced at the start of every GPU command (device tool): installs the carried wheels.
# Usage on the device: source benchmarks/device_setup.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DISABLE_BEARTYPE=1
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, torch.cuda.get_device_name())"
