"""Fit the four quintics of ``Muon(orthogonalizer="fast")`` to the default's five.

    python scripts/fit_fast_schedule.py            # prints the schedule and its response

What is fitted (float64, L-BFGS, deterministic): on a log grid of normalized singular
values ``1e-5 <= s <= 1.02`` let ``f`` be five applications of torch.optim.Muon's quintic
and ``g`` four quintics with free coefficients. The loss is

* the squared log-ratio of the locally averaged RMS of ``g`` to that of ``f`` (Gaussian
  window of 0.15 decades: what a spread of nearby singular values receives on average),
* plus the same for the local mean (the update's alignment with the momentum),
* plus stiff penalties that keep ``g`` in ``[0.62, 1.26]`` wherever ``f`` has reached its
  band (the default's own band is [0.68, 1.20]) and every intermediate iterate in
  ``[0, 1.5]`` (bf16 headroom: no iterate may overflow or change sign).

The start is the default's quintic four times; the result is ``FAST_SCHEDULE`` in
``lightning_matrixfsdp/optim/fast.py`` (about a minute on two CPU cores).
"""

from __future__ import annotations

import math

import torch

DEFAULT = (3.4445, -4.775, 2.0315)
LOW, HIGH, INTERMEDIATE = 0.62, 1.26, 1.5
WINDOW_DECADES = 0.15
PENALTY = 1000.0


def quintic(x: torch.Tensor, a: float | torch.Tensor, b: float | torch.Tensor, c: float | torch.Tensor) -> torch.Tensor:
    """The odd quintic ``a x + b x^3 + c x^5`` (coefficients may be tensors: autograd)."""
    x2 = x * x
    return x * (a + x2 * (b + c * x2))


def fit(steps: int = 4, points: int = 3000, rounds: int = 6) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Return the fitted coefficients (flat, ``3 * steps``) and the curves for a report."""
    s = torch.logspace(-5, math.log10(1.02), points, dtype=torch.float64)
    target = s.clone()
    for _ in range(5):
        target = quintic(target, *DEFAULT)
    logs = torch.log10(s)
    kernel = torch.exp(-0.5 * ((logs[:, None] - logs[None, :]) / WINDOW_DECADES) ** 2)
    kernel = kernel / kernel.sum(1, keepdim=True)
    target_mean, target_rms = kernel @ target, (kernel @ target**2).sqrt()
    in_band = target.cummax(0).values > 0.95  # from where the default first reaches its band

    def response(coefficients: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        g, iterates = s, []
        for t in range(steps):
            g = quintic(g, *coefficients[3 * t:3 * t + 3])
            iterates.append(g)
        return g, iterates

    def loss(coefficients: torch.Tensor) -> torch.Tensor:
        g, iterates = response(coefficients)
        rms = (kernel @ g**2).clamp(min=1e-30).sqrt()
        mean = (kernel @ g).clamp(min=1e-30)
        value = torch.log(rms / target_rms).pow(2).mean() + torch.log(mean / target_mean).pow(2).mean()
        band = g[in_band]
        value = value + PENALTY * (torch.relu(band - HIGH) ** 2 + torch.relu(LOW - band) ** 2).mean()
        for it in iterates[:-1]:
            value = value + PENALTY * (torch.relu(it - INTERMEDIATE) ** 2 + torch.relu(-it) ** 2).mean()
        return value

    coefficients = torch.tensor(list(DEFAULT) * steps, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([coefficients], max_iter=500, line_search_fn="strong_wolfe",
                            tolerance_grad=1e-12, tolerance_change=1e-15)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        value = loss(coefficients)
        value.backward()
        return value

    for _ in range(rounds):
        opt.step(closure)
    g, iterates = response(coefficients.detach())
    curves = {"s": s, "default": target, "fast": g, "default_rms": target_rms,
              "fast_rms": (kernel @ g**2).sqrt(), "in_band": in_band,
              "intermediate_max": torch.stack([it.max() for it in iterates])}
    return coefficients.detach().tolist(), curves


def main() -> None:
    coefficients, c = fit()
    print("FAST_SCHEDULE = (")
    for t in range(0, len(coefficients), 3):
        print("    (" + ", ".join(f"{v:.6f}".rstrip("0") for v in coefficients[t:t + 3]) + "),")
    print(")")
    slope = math.prod(coefficients[0::3])
    print(f"slope at 0: {slope:.1f} (default {DEFAULT[0] ** 5:.1f}, ratio {slope / DEFAULT[0] ** 5:.3f})")
    band = c["fast"][c["in_band"]]
    print(f"band: [{band.min():.3f}, {band.max():.3f}] (default [{c['default'][c['in_band']].min():.3f}, "
          f"{c['default'][c['in_band']].max():.3f}]); intermediate max {c['intermediate_max'].max():.3f}")
    ratio = c["fast_rms"] / c["default_rms"]
    print(f"local RMS ratio to the default: {ratio.min():.3f} - {ratio.max():.3f}")
    for i in range(0, len(c["s"]), 300):
        print(f"  s={c['s'][i]:.2e}  default {c['default'][i]:.3f}  fast {c['fast'][i]:.3f}  "
              f"local RMS {c['default_rms'][i]:.3f} / {c['fast_rms'][i]:.3f}")


if __name__ == "__main__":
    main()
