"""``model.dtype = "fp8"``: the decoder's large matmuls in float8 through torchao's float8 training.

A model transform, applied in one place before compile and before the engine wraps the model (as torchtitan's
float8 converter runs before its parallelisms, torchtitan/components/quantization/float8.py): each ``nn.Linear``
that passes ``converts`` becomes torchao's ``Float8Linear``, which casts its input, weight and output gradient to
float8 with dynamic scales (one per tensor: ``tensorwise``; one per row: ``rowwise``) and multiplies on the float8
tensor cores. Everything else runs under the bf16 autocast a ``bf16`` run uses; parameters, gradients and the
optimizer stay fp32, and the state dict keeps ``nn.Linear``'s names, so checkpoints and exports are unchanged.

Only where the hardware has float8 tensor cores (CUDA capability 8.9: Ada; 9.0: H100/H200) and torchao imports;
elsewhere the run is refused in one line (``check_fp8``). torchao is not a treadle dependency.
"""

from __future__ import annotations

import importlib.metadata
from typing import Callable

import torch
from torch import nn

from treadle.errors import UserError

RECIPES = ("tensorwise", "rowwise")
MIN_CAPABILITY = (8, 9)  # the first with float8 tensor cores (torch._scaled_mm's requirement)
ENGINES = ("local", "ddp", "fsdp2")

# Which torchao releases go with which torch (each release's torchao/__init__.py compatibility check: 0.13 was built
# for torch 2.8, 0.14.1 for 2.9, 0.15 for 2.9.1, 0.16 for 2.10, 0.17 and 0.18 require torch >= 2.11).
TORCHAO_FOR_TORCH = (((2, 11), "torchao>=0.17"), ((2, 10), "torchao==0.16.*"), ((2, 9), "torchao>=0.14.1,<0.16"),
                     ((2, 8), "torchao==0.13.*"))


def torchao_requirement(torch_version: str) -> str | None:
    """The pip requirement of the torchao releases built for ``torch_version`` (None: torch older than any)."""
    major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    return next((req for since, req in TORCHAO_FOR_TORCH if (major, minor) >= since), None)


def converts(out_features: int, in_features: int, recipe: str) -> bool:
    """Whether a linear layer of this shape is worth float8 under ``recipe``.

    torchao's own rule (torchao/float8/float8_linear_utils.py, ``_auto_filter_for_recipe``, thresholds from its
    H100 benchmarks in torchao/float8/README.md): both dimensions divisible by 16 (a float8 matmul's hardware
    requirement), and large enough that the matmul saves more than the casts to float8 cost. N = out_features,
    K = in_features. tensorwise: not when K <= 4096 and N <= 1024. rowwise (its scales cost more): not when
    N <= 2048, nor K <= 1024, nor N <= 4096 and K <= 2048.
    """
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    raise ValueError(f"unknown float8 recipe {recipe!r}; accepted: {', '.join(RECIPES)}")


def layer_filter(model: nn.Module, recipe: str) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn`` for ``model``: the linear layers ``converts`` keeps, never the LM head (its
    logits feed the loss directly; torchtitan leaves its ``output`` layer out too). Embeddings are not linear."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def keep(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or module is head:
            return False
        return converts(module.out_features, module.in_features, recipe)

    return keep


def torchao_version() -> str | None:
    """The installed torchao whose float8 training imports, else None."""
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # noqa: BLE001 - missing, or built for another torch: either way unusable here
        return None
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def run_refusal(engine: str, draft: bool, tensor_parallel: int, accepted: str) -> str | None:
    """Why this kind of run cannot train in fp8 (one line), or None; ``accepted``: the dtypes it can."""
    key = "model.dtype = 'fp8'"
    if draft:
        return (f"{key} is not available to a draft run (a frozen target and a one-block draft: treadle does not "
                f"convert them); accepted: model.dtype = {accepted}")
    if engine not in ENGINES:
        return (f"{key} is not available to distributed.engine {engine!r} (torchao's float8 layers run here under "
                f"{', '.join(ENGINES)}); accepted: fp8 with engine {' / '.join(ENGINES)}, or model.dtype = {accepted}")
    if tensor_parallel > 1:
        return (f"{key} is not available with distributed.tensor_parallel = {tensor_parallel} (treadle's tensor "
                f"parallel plans split plain nn.Linear, not torchao's Float8Linear); accepted: fp8 with "
                f"tensor_parallel = 1, or model.dtype = {accepted}")
    return None


def hardware_refusal(device: str, capability: tuple[int, int] | None, torchao: str | None, torch_version: str,
                     accepted: str) -> str | None:
    """Why this machine cannot train in fp8 (one line), or None. ``device``: the device as the line names it;
    ``capability``: its CUDA capability (None: not a CUDA device); ``torchao``: the installed version or None."""
    key = "model.dtype = 'fp8'"
    if capability is None or capability < MIN_CAPABILITY:
        found = device if capability is None else f"{device}, CUDA capability {capability[0]}.{capability[1]}"
        return (f"{key} needs float8 tensor cores (CUDA capability >= 8.9: H100, H200, Ada), but this run's device "
                f"is {found}; accepted here: model.dtype = {accepted}")
    if torchao is None:
        req = torchao_requirement(torch_version)
        install = (f"pip install '{req}' (the torchao releases for torch {torch_version})" if req else
                   f"torch {torch_version} is older than any torchao release treadle knows (torch >= 2.8)")
        return (f"{key} trains through torchao, which is not installed or does not import: {install}; accepted "
                f"without it: model.dtype = {accepted}")
    return None


def check_fp8(engine: str, draft: bool, tensor_parallel: int, device: torch.device | None, accepted: str) -> None:
    """Refuse fp8 where it cannot run, in one line: the kind of run, then (``device`` given) the machine."""
    why = run_refusal(engine, draft, tensor_parallel, accepted)
    if why is None and device is not None:
        cuda = device.type == "cuda"
        capability = torch.cuda.get_device_capability(device) if cuda else None
        shown = f"{device} ({torch.cuda.get_device_name(device)})" if cuda else str(device)
        capable = capability is not None and capability >= MIN_CAPABILITY
        why = hardware_refusal(shown, capability, torchao_version() if capable else None, torch.__version__, accepted)
    if why is not None:
        raise UserError(why)


def apply_fp8(model: nn.Module, recipe: str) -> str:
    """Swap ``model``'s linear layers that ``layer_filter`` keeps for torchao's ``Float8Linear`` (in place); the
    start line saying which."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    convert_to_float8_training(model, module_filter_fn=layer_filter(model, recipe),
                               config=Float8LinearConfig.from_recipe_name(recipe))
    done = sum(isinstance(m, Float8Linear) for m in model.modules())
    return (f"treadle: model.dtype = fp8 ({recipe}, torchao {torchao_version()}): {done} of {len(linears)} linear "
            "layers in float8, the rest (LM head, layers too small to pay) in bf16 autocast")
