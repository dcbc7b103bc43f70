"""A LoRA-style model ~4x a budget built under infinity.Init (NVMe home), its base frozen
and kept quantized by ``offload.frozen_weights``: peak RSS of building it, and of
``initialize`` quantizing it group by group as it adopts it; the engine's frozen values
against the quantize round trip of the same model built eagerly; one training step.
argv: swap_dir budget_bytes dtype. Prints one JSON line."""
import json
import resource
import sys

import torch
from torch import nn

import infinity
from infinity.quant import quantize_weight
from infinity.zero.init import Init


class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.a = nn.Linear(d, 4, bias=False)
        self.b = nn.Linear(4, d, bias=False)

    def forward(self, x):
        return torch.relu(self.base(x) + self.b(self.a(x)))


class Big(nn.Module):
    def __init__(self, layers, d):
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(layers))

    def forward(self, x):
        for m in self.layers:
            x = m(x)
        return x.square().mean()


def freeze(model):
    for m in model.layers:
        m.base.requires_grad_(False)


def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    swap, budget, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    d = 1024
    layers = (4 * budget) // ((d * d + d) * 4) + 1
    init_cfg = {"offload": {"params": "nvme", "nvme_paths": [swap]}}
    cfg = {"offload": {"params": "nvme", "optimizer": "cpu", "nvme_paths": [swap],
                       "frozen_weights": {"dtype": None if dtype == "none" else dtype}},
           "optimizer": {"lr": 1e-3}}
    with Init(init_cfg):                 # warm up: engine, swap, allocator, quantizer
        warm = Big(1, d)
    freeze(warm)
    with infinity.initialize(warm, cfg) as e:
        e.backward(e(torch.randn(2, d)))
        e.step()
    del warm, e
    base = rss()
    torch.manual_seed(0)
    with Init(init_cfg):
        model = Big(layers, d)
    freeze(model)
    built = rss()
    eng = infinity.initialize(model, cfg)
    adopted = rss()
    quant = sum(1 for g in eng.grouping.groups if g.quant is not None)
    loss = eng(torch.randn(2, d))
    eng.backward(loss)
    eng.step()
    trained = rss()
    # the frozen values: the quantize round trip of the same weights built eagerly
    sd = eng.state_dict()
    picks = (0, layers // 2, layers - 1)
    got = {i: sd[f"layers.{i}.base.weight"].clone() for i in picks}
    eng.close()
    torch.manual_seed(0)
    ref = Big(layers, d)
    same = all(torch.equal(got[i], ref.layers[i].base.weight if dtype == "none" else
                           quantize_weight(ref.layers[i].base.weight, dtype).dequantize())
               for i in picks)
    nbytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    print(json.dumps({"base": base, "built": built, "adopted": adopted, "trained": trained,
                      "model_bytes": nbytes, "layers": layers, "quantized_groups": quant,
                      "same": same, "loss": float(loss)}))


if __name__ == "__main__":
    main()
