"""Are the shipped RST-CNN's filter spectra band-limited enough to skip frequencies? For each
group convolution and block of scales, the energy of its spectra (all input and output
channels, the two base rotations) outside the square band |n|, f <= c of its periodic grid,
and the largest amplitude there against the largest overall, for the smallest c that leaves
less than 1e-3 of the energy outside, and beyond.

    python results/bench/band-s27.py
"""

from pathlib import Path

import torch

from rstmodel import load_checkpoint

net, meta = load_checkpoint(Path(__file__).resolve().parents[2] / "models" / "rst_cnn_fb.pt")
convs = [m for m in net.modules() if type(m).__name__ == "GroupRSTConv"]
print("| layer | scale | grid | c | frequencies kept | energy outside | largest amplitude outside |")
print("|---|---|---|---|---|---|---|")
for layer, (conv, h) in enumerate(zip(convs, (meta.input_size // 2, meta.input_size // 4)), 2):
    for first, end, nh, nw in conv.scale_blocks(h, h):
        fw = nw // 2 + 1
        with torch.no_grad():
            re, im = conv.spectra(nh, nw, conv.spec.rotations // 4, range(first, end), gauss=False)
        energy = (re**2 + im**2).view(nh, fw, -1).sum(-1)
        n = torch.arange(nh)
        dist = torch.minimum(n, nh - n)
        for c in range(1, fw):
            inside = (dist[:, None] <= c) & (torch.arange(fw)[None] <= c)
            out = (energy[~inside].sum() / energy.sum()).item()
            amp = (energy[~inside].max() / energy.max()).sqrt().item() if (~inside).any() else 0.0
            if out < 1e-3:
                print(
                    f"| {layer} | {first} | {nh} | {c} | {int(inside.sum())} / {nh * fw} | "
                    f"{out:.1e} | {amp:.1e} |"
                )
            if out == 0.0:
                break
