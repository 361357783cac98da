import sys

import torch

sys.path.insert(0, ".")
if sys.argv[1] == "sgd":
    import mpgemm
    from tests.test_fused_optim import OPTIMIZERS, _mlp

    ours_make, torch_make = OPTIMIZERS["sgd"]
    runs = []
    for make, sc in (
        (ours_make, mpgemm.GradScaler),
        (torch_make, torch.amp.GradScaler),
        (torch_make, torch.amp.GradScaler),
        (ours_make, mpgemm.GradScaler),
    ):
        model = _mlp("cpu")
        model[0].cuda()
        opt, scaler = make(model.parameters()), sc("cuda", init_scale=2.0**8)
        g = torch.Generator().manual_seed(1)
        for i in range(3):
            x, y = torch.randn(32, 12, generator=g), torch.randn(32, 3, generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model[1:](model[0](x.cuda()).cpu()), y)
            scaler.scale(loss.cuda()).backward()
            scaler.step(opt)
            scaler.update()
            print(
                type(opt).__module__,
                i,
                "scale",
                float(scaler.get_scale()),
                [(p.device.type, float(p.grad.abs().max())) for p in model.parameters()],
            )
        runs.append([p.detach().cpu().clone() for p in model.parameters()])
    for a, b in ((0, 1), (1, 2), (0, 3)):
        print(a, b, [float((p - q).abs().max()) for p, q in zip(runs[a], runs[b], strict=False)])
else:
    import tests.test_launches as t

    src = open("tests/test_launches.py").read()
    import inspect

    s = (
        inspect.getsource(t._compare_pdl_step)
        .replace(
            "    plain = step()\n",
            "    plain = step()\n"
            "    for _ in range(3): print('plain-again', [k.name for k in step()])\n",
        )
        .replace(
            "assert [k.name for k in dependent] == [k.name for k in plain]",
            "print('plain', [k.name for k in plain]); print('dep', [k.name for k in dependent])",
        )
    )
    ns = dict(vars(t))
    exec(s, ns)
    ns["_compare_pdl_step"]()
