"""Losses and batch transforms shared by algorithms (Flower-free, plain tensors)."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean_i -sum_c q_ic log softmax(logits_i)_c, for soft labels q (rows summing to one)."""
    return -(target * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def mean_output_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """FedAug's AugMean (eq. 3 of the earlier version): cross-entropy between the batch's MEAN softmax
    output and the mean target (the uniform prior for RSM pseudo-data)."""
    mean_prob = F.softmax(logits, dim=1).mean(dim=0)
    return -(target.mean(dim=0) * torch.log(mean_prob.clamp_min(1e-12))).sum()


def fedbr_contrastive_loss(p_local_pseudo: torch.Tensor, p_global_pseudo: torch.Tensor,
                           p_local_real: torch.Tensor, tau1_scale: float, tau2_scale: float) -> torch.Tensor:
    """FedBR's L_con on projected features, pairs matched element-wise:
    mean_i -log(e^{s1_i} / (e^{s1_i} + e^{s2_i})) with s1 = tau1 * cos(local pseudo, global pseudo) and
    s2 = tau2 * cos(local pseudo, local real). Written as softplus(s2 - s1), which is the same value
    without overflow."""
    s1 = tau1_scale * F.cosine_similarity(p_local_pseudo, p_global_pseudo, dim=1)
    s2 = tau2_scale * F.cosine_similarity(p_local_pseudo, p_local_real, dim=1)
    return F.softplus(s2 - s1).mean()


def mixup_batch(x: torch.Tensor, y: torch.Tensor, lam: float, perm: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lam * x + (1 - lam) * x[perm], y, y[perm]); the loss mixes the two labels with lam."""
    return lam * x + (1.0 - lam) * x[perm], y, y[perm]


def mixup_cross_entropy(logits: torch.Tensor, y_a: torch.Tensor, y_b: torch.Tensor, lam: float) -> torch.Tensor:
    return lam * F.cross_entropy(logits, y_a) + (1.0 - lam) * F.cross_entropy(logits, y_b)


class MixupSampler:
    """Mixup's lam ~ Beta(a, a) on the host (a plain float, so no device sync) and a permutation
    of the batch on the device, both seeded."""

    def __init__(self, alpha: float, seed: int, device: torch.device):
        self.alpha = alpha
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, batch_size: int) -> tuple[float, torch.Tensor]:
        lam = float(self.rng.beta(self.alpha, self.alpha))
        return lam, torch.randperm(batch_size, generator=self.generator, device=self.generator.device)


# ---------------------------------------------------------------- baselines (SPEC section 4)


def proximal_term(params: list[torch.Tensor], anchor: list[torch.Tensor]) -> torch.Tensor:
    """FedProx: sum ||w - w_round_start||^2 over all parameters (the loss adds mu/2 times this, so
    its gradient adds mu (w - w_round_start))."""
    return torch.stack([(p - a).pow(2).sum() for p, a in zip(params, anchor)]).sum()


def moon_contrastive_loss(z: torch.Tensor, z_global: torch.Tensor, z_previous: torch.Tensor,
                          tau: float) -> torch.Tensor:
    """MOON: mean_i -log(e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau})),
    as softplus of the difference (same value, no overflow)."""
    pos = F.cosine_similarity(z, z_global, dim=1) / tau
    neg = F.cosine_similarity(z, z_previous, dim=1) / tau
    return F.softplus(neg - pos).mean()


def fedmix_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, x_mean: torch.Tensor,
                y_mean: torch.Tensor, lam: float) -> dict[str, torch.Tensor]:
    """FedMix (Yoon et al. 2021, eq. 5): the first-order Taylor approximation of Mixup between a local
    sample x_i and a global mean sample (x_mean_j, y_mean_j), around (1 - lam) x_i:

        (1 - lam) CE(f((1 - lam) x_i), y_i) + lam CE_soft(f((1 - lam) x_i), y_mean_j)
        + lam <d CE(f((1 - lam) x_i), y_i) / dx, x_mean_j>.

    The input gradient is per sample (our backbones have no batch-coupled layers), kept in the graph
    so that the last term trains the model. At lam = 0 this is plain cross-entropy."""
    x_in = ((1.0 - lam) * x).requires_grad_(True)
    logits = model(x_in)
    ce_each = F.cross_entropy(logits, y, reduction="none")
    ce = ce_each.mean()
    mean_label = soft_cross_entropy(logits, y_mean)
    (grad_x,) = torch.autograd.grad(ce_each.sum(), x_in, create_graph=True)
    taylor = (grad_x * x_mean).flatten(1).sum(dim=1).mean()
    loss = (1.0 - lam) * ce + lam * mean_label + lam * taylor
    return {"loss": loss, "ce": ce, "mean-label": mean_label, "taylor": taylor}


def decorrelation_loss(z: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """FedDecorr (Shi et al. 2023): ||K||_F^2 / d^2 with K the d x d correlation matrix of the batch's
    features, each dimension z-scored over the batch."""
    n, d = z.shape
    z = (z - z.mean(dim=0)) / torch.sqrt(z.var(dim=0, unbiased=False) + eps)
    corr = z.T @ z / n
    return corr.pow(2).sum() / (d * d)


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, C) -> (B, C-1): every logit except the true class's."""
    keep = torch.ones_like(logits, dtype=torch.bool).scatter_(1, y[:, None], False)
    return logits[keep].view(len(y), logits.shape[1] - 1)


def not_true_distillation_loss(logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor,
                               tau: float) -> torch.Tensor:
    """FedNTD (Lee et al. 2022): tau^2 KL(softmax(g~/tau) || softmax(l~/tau)) over the not-true
    classes only, batch mean, with g the round-start global model's logits."""
    local = F.log_softmax(not_true_logits(logits, y) / tau, dim=1)
    target = F.softmax(not_true_logits(global_logits, y) / tau, dim=1)
    return tau * tau * F.kl_div(local, target, reduction="batchmean")


def supervised_alignment_loss(z_real: torch.Tensor, y_real: torch.Tensor, z_virtual: torch.Tensor,
                              y_virtual: torch.Tensor, tau: float) -> torch.Tensor:
    """VHL's feature alignment as a supervised contrastive loss: each real feature (anchor) against the
    batch's virtual features; positives are the virtual samples of the anchor's class. Anchors with no
    positive in the batch are left out."""
    sim = F.normalize(z_real, dim=1) @ F.normalize(z_virtual, dim=1).T / tau  # (B_real, B_virtual)
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    positive = (y_real[:, None] == y_virtual[None, :]).to(sim.dtype)
    count = positive.sum(dim=1)
    per_anchor = -(log_prob * positive).sum(dim=1) / count.clamp_min(1)
    has = (count > 0).to(sim.dtype)
    return (per_anchor * has).sum() / has.sum().clamp_min(1)


class _ReverseGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coeff):
        ctx.coeff = coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.coeff * grad, None


def reverse_gradient(x: torch.Tensor, coeff: float = 1.0) -> torch.Tensor:
    """Identity forward; the gradient is multiplied by -coeff backward (DANN's gradient reversal)."""
    return _ReverseGradient.apply(x, coeff)


def blend_with_global_momentum(grads: list[torch.Tensor], momentum: list[torch.Tensor], alpha: float) -> None:
    """FedCM, in place: g <- alpha g + (1 - alpha) Delta_global."""
    torch._foreach_mul_(grads, alpha)
    torch._foreach_add_(grads, momentum, alpha=1.0 - alpha)
