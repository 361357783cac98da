"""A LoRA-like step on the GPU: seven frozen layers (784 -> 4096, six 4096-wide), a trained
head; mpgemm (converted, its GradScaler and AdamW) against autocast + torch's GradScaler +
AdamW(fused).
Wall ms per step (median of 5 windows of 10 steps), and the CUDA kernel count a step."""

import json
import statistics
import sys
import time

import torch
from torch import nn

import mpgemm


def model_and_opt(recipe):
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(4096, 4096), nn.ReLU()]
    model = nn.Sequential(nn.Linear(784, 4096), nn.ReLU(), *layers, nn.Linear(4096, 10)).cuda()
    if recipe == "mpgemm":
        mpgemm.convert(model)
    model[:-1].requires_grad_(False)
    head = [p for p in model.parameters() if p.requires_grad]
    if recipe == "mpgemm":
        return model, mpgemm.optim.AdamW(head, lr=1e-4), mpgemm.GradScaler("cuda")
    return model, torch.optim.AdamW(head, lr=1e-4, fused=True), torch.amp.GradScaler("cuda")


def run(recipe, x, y):
    model, opt, scaler = model_and_opt(recipe)

    def step():
        opt.zero_grad(set_to_none=True)
        if recipe == "autocast":
            with torch.autocast("cuda", dtype=torch.float16):
                logits = model(x)
            loss = nn.functional.cross_entropy(logits.float(), y)
        else:
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    windows = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        windows.append((time.perf_counter() - t) / 10 * 1e3)
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    casts = sum(1 for e in kernels if "copy" in e.name.lower() or "cast" in e.name.lower())
    names = {}
    for e in kernels:
        names[e.name[:80]] = names.get(e.name[:80], 0) + 1
    return {
        "ms_median": statistics.median(windows),
        "ms_min": min(windows),
        "windows": windows,
        "peak_mib": peak,
        "kernels": len(kernels),
        "copy_like_kernels": casts,
        "kernel_names": names,
    }


x = torch.randn(8192, 784, device="cuda")
y = torch.randint(0, 10, (8192,), device="cuda")
out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
for recipe in ("autocast", "mpgemm", "autocast", "mpgemm"):
    r = run(recipe, x, y)
    out.setdefault(recipe, []).append(r)
    print(
        recipe,
        f"{r['ms_median']:.3f} ms (min {r['ms_min']:.3f}), peak {r['peak_mib']:.0f} MiB,",
        f"{r['kernels']} kernels, {r['copy_like_kernels']} copy-like",
        flush=True,
    )
json.dump(out, open(sys.argv[1], "w"), indent=1)
