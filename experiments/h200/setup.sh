# Sourced at the start of every H200 run: wheels the image lacks, env, device facts.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
export JAXSPEC_COMMIT=$(cat .carry/commit 2>/dev/null || echo unknown)
mkdir -p /tmp/jaxspec_stage ~/.cache/jaxspec
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
