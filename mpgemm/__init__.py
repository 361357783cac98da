"""mpgemm: mixed-precision GEMMs for PyTorch training.

16-bit (FP16 or BF16) operands on the Tensor Cores, FP32 accumulation, FP32 master
weights. CUDA tensors run Triton kernels; CPU tensors run the reference implementation
with the same numerics (or the Triton kernels themselves under ``TRITON_INTERPRET=1``,
which must be set before ``triton`` is first imported).
"""

from importlib.metadata import PackageNotFoundError, version

from mpgemm import optim
from mpgemm.functional import backend, linear, matmul
from mpgemm.grad_scaler import GradScaler
from mpgemm.loss_scale_optimizer import LossScaleOptimizer
from mpgemm.losses import cross_entropy
from mpgemm.modules import Linear, convert
from mpgemm.reference import linear_ref, matmul_ref

try:
    __version__ = version("mpgemm")  # pyproject.toml's, as installed
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "GradScaler",
    "Linear",
    "LossScaleOptimizer",
    "backend",
    "convert",
    "cross_entropy",
    "linear",
    "linear_ref",
    "matmul",
    "matmul_ref",
    "optim",
]
