"""The SAE being trained (`TrainingSAE`): its parameters in the normalised input space, the
TopK and ReLU losses, one Adam step, the held-out measurement, and the SAE of raw
activations it becomes.

Apart from the training loop (`envoykit.analyses.sae_training`) because this is the
recipe's arithmetic, with the sparse encoder backward (`_Picked`) it needs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from envoykit.analyses.sae import SAE
from envoykit.analyses.sae_hooks import tl_hook
from envoykit.analyses.sae_plan import AUXK_ALPHA, Plan

# Rows per chunk when the held-out rows are encoded.
EVAL_ROWS = 1024


class _Picked(torch.autograd.Function):
    """The pre-activations ``pre`` of the latents ``picked`` per token (``[tokens, n]``),
    whose gradient reaches only those latents' encoder rows: computed sparsely (an
    embedding bag and a sparse product), where autograd through the dense ``x @ W.T`` would
    multiply mostly zeros. sparsify's fused encoder does the same on GPU. ``bias`` is
    there for its gradient (``pre`` holds it already)."""

    @staticmethod
    def forward(ctx, x, weight, bias, picked, pre):
        ctx.save_for_backward(x, weight, picked)
        return pre.gather(-1, picked)

    @staticmethod
    def backward(ctx, grad):
        x, weight, picked = ctx.saved_tensors
        flat = picked.flatten()
        grad_x = F.embedding_bag(picked, weight, per_sample_weights=grad, mode="sum")
        tokens = torch.arange(len(x)).repeat_interleave(picked.shape[1])
        sparse = torch.sparse_coo_tensor(
            torch.stack([flat, tokens]),
            grad.flatten(),
            (len(weight), len(x)),
            check_invariants=False,
        )
        grad_weight = torch.sparse.mm(sparse, x)
        grad_bias = torch.zeros(len(weight), dtype=grad.dtype).index_add_(0, flat, grad.flatten())
        return grad_x, grad_weight, grad_bias, None, None


class TrainingSAE:
    """The SAE's parameters in the normalised space (inputs times `Plan.scale`), Adam, and
    the tokens since each latent last fired."""

    def __init__(self, plan: Plan, mean: torch.Tensor, generator: torch.Generator) -> None:
        self.plan = plan
        directions = torch.randn(plan.d_sae, plan.d_in, generator=generator)
        # Unit rows for TopK (Gao et al.); SAELens's decoder_init_norm of 0.1 for ReLU.
        norm = 1.0 if plan.architecture == "topk" else 0.1
        decoder = F.normalize(directions, dim=-1) * norm
        self.W_dec = decoder.requires_grad_()
        self.W_enc = decoder.detach().clone().requires_grad_()  # [d_sae, d_in]: W_enc.T
        self.b_enc = torch.zeros(plan.d_sae, requires_grad=True)
        self.b_dec = (mean * plan.scale).float().requires_grad_()
        self.optimizer = torch.optim.Adam(self.parameters(), lr=plan.lr)
        self.since_fired = torch.zeros(plan.d_sae, dtype=torch.long)

    def parameters(self) -> list[torch.Tensor]:
        return [self.W_enc, self.b_enc, self.W_dec, self.b_dec]

    @property
    def dead(self) -> torch.Tensor:
        return self.since_fired > self.plan.dead_tokens

    def step(self, x: torch.Tensor, mean: torch.Tensor) -> tuple[float, float]:
        """One Adam step on the normalised batch ``x``; its loss and mean L0. The fraction of
        variance unexplained is over the batch's spread about the training rows' ``mean``
        (sparsify uses the batch's own mean: the same for a large batch, and defined for
        one token)."""
        spread = (x - mean).pow(2).sum()
        if self.plan.architecture == "topk":
            loss, acts, picked = self._topk_loss(x, spread)
            fired = picked[acts > 0]
        else:
            loss, acts = self._relu_loss(x)
            fired = (acts > 0).any(0).nonzero().flatten()
        loss.backward()
        with torch.no_grad():
            if self.plan.architecture == "topk":
                # Only the gradient that turns a row moves it; then the rows are unit again.
                grad, rows = self.W_dec.grad, self.W_dec
                grad -= (grad * rows).sum(1, keepdim=True) * rows
            self.optimizer.step()
            self.optimizer.zero_grad()
            if self.plan.architecture == "topk":
                eps = torch.finfo(torch.float32).eps
                self.W_dec /= self.W_dec.norm(dim=1, keepdim=True) + eps
            self.since_fired += len(x)
            self.since_fired[fired] = 0
        return float(loss.detach()), float((acts > 0).sum(-1).float().mean())

    def _topk_loss(
        self, x: torch.Tensor, spread: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert self.plan.k is not None  # `check_options` gives a TopK run its k
        k = int(self.plan.k)
        centred = x - self.b_dec
        with torch.no_grad():
            pre = torch.addmm(self.b_enc, centred, self.W_enc.T)
        picked = pre.topk(k, dim=-1).indices
        acts = _Picked.apply(centred, self.W_enc, self.b_enc, picked, pre).relu()
        recon = F.embedding_bag(picked, self.W_dec, per_sample_weights=acts, mode="sum")
        error = x - (recon + self.b_dec)
        loss = error.pow(2).sum() / spread
        dead = self.dead
        n_dead = int(dead.sum())
        k_aux = min(self.plan.d_in // 2, n_dead)
        if k_aux:
            # AuxK: the top dead latents reconstruct what the live ones missed, scaled down
            # while few are dead (sparsify's sparse_coder.py, Gao et al. appendix B.1).
            scale = min(n_dead / (self.plan.d_in // 2), 1.0)
            aux = pre.masked_fill(~dead, -math.inf).topk(k_aux, dim=-1).indices
            aux_acts = _Picked.apply(centred, self.W_enc, self.b_enc, aux, pre).relu()
            guess = F.embedding_bag(aux, self.W_dec, per_sample_weights=aux_acts, mode="sum")
            auxk = scale * (guess - error.detach()).pow(2).sum() / spread
            loss = loss + AUXK_ALPHA * auxk
        return loss, acts, picked

    def _relu_loss(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # SAELens 6's StandardTrainingSAE: squared error summed over d_in, mean over tokens,
        # plus the L1 of the activations weighted by the decoder rows' norms.
        acts = ((x - self.b_dec) @ self.W_enc.T + self.b_enc).relu()
        recon = acts @ self.W_dec + self.b_dec
        mse = (x - recon).pow(2).sum(-1).mean()
        sparsity = (acts * self.W_dec.norm(dim=1)).sum(-1).mean()
        assert self.plan.l1_coefficient is not None  # `check_options` gives a ReLU run one
        return mse + float(self.plan.l1_coefficient) * sparsity, acts

    @torch.no_grad()
    def unexplained(self, held_out: torch.Tensor, spread: float) -> float:
        """The fraction of the (normalised) held-out rows' variance left unexplained."""
        error = 0.0
        for chunk in held_out.split(EVAL_ROWS):
            acts = self._encode(chunk)
            recon = acts @ self.W_dec + self.b_dec
            error += float((chunk - recon).pow(2).sum(dtype=torch.float64))
        return error / spread

    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        pre = (x - self.b_dec) @ self.W_enc.T + self.b_enc
        if self.plan.architecture == "relu":
            return pre.relu()
        assert self.plan.k is not None  # `check_options` gives a TopK run its k
        top = pre.topk(int(self.plan.k), dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())

    def state(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name).detach().clone() for name in _STATE}

    def sae(self, state: dict[str, torch.Tensor]) -> SAE:
        """``state`` as the SAE of raw activations: the input scale folded into the weights."""
        plan, s = self.plan, self.plan.scale
        return SAE(
            architecture=plan.architecture,
            W_enc=(state["W_enc"].T * s).contiguous(),
            b_enc=state["b_enc"],
            W_dec=state["W_dec"] / s,
            b_dec=state["b_dec"] / s,
            layer=plan.layer,
            site=plan.site,
            k=plan.k,
            apply_b_dec_to_input=True,
            normalize_activations="none",
            hook_name=tl_hook(plan.layer, plan.site),
            model_name=plan.model_name,
            source=f"trained on {plan.source}",
        )


_STATE = ("W_enc", "b_enc", "W_dec", "b_dec")
