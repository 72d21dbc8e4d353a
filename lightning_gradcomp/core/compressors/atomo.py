"""Spectral ATOMO (Wang et al., "ATOMO: Communication-efficient Learning via Atomic Sparsification", NeurIPS 2018).

ATOMO writes a gradient as a sum of orthonormal atoms, ``g = sum_i lambda_i a_i``, and sends the
unbiased sparsification (paper Sec. 3, "ATOMO: atomic decomposition and sparsification")

    g_hat = sum_i (lambda_i t_i / p_i) a_i,        t_i ~ Bernoulli(p_i) independently,

with the probabilities that minimise its variance ``E||g_hat - g||^2 = sum_i lambda_i^2 (1/p_i - 1)``
for an expected number of atoms ``sum_i p_i = s`` (Sec. 3, the variance-minimisation problem,
solved by Algorithm 1). *Spectral* ATOMO (Sec. 5) takes the atoms of the singular value
decomposition of each layer's gradient viewed as a matrix, ``G = sum_i sigma_i u_i v_i^T``: each
kept atom costs ``m + n + 1`` numbers (``u_i``, ``v_i`` and ``sigma_i / p_i``), about
``s (m + n + 1)`` per layer on average instead of ``m n``.

Choices of this implementation (each one documented where it happens):

* **Probabilities**: :func:`atomo_probabilities` solves that problem exactly (Algorithm 1, the
  water-filling), vectorised with one sort and one cumulative sum. The authors' code uses a
  single pass ``p_i = min(1, s |lambda_i| / sum_j |lambda_j|)`` that spends less than ``s`` as
  soon as one probability is clipped; it is kept as :func:`one_pass_probabilities`, for
  comparison only. The authors' code also re-draws when no atom was kept, which biases the
  estimator; this implementation does not (an empty payload is a valid, unbiased draw).
* **Decomposition**: the estimator is unbiased for any orthonormal atoms; the singular ones give
  the least variance (:mod:`~lightning_gradcomp.core.compressors.spectral`). By default a layer whose
  smaller side is at least four times the sketch's rank is first sketched: a randomized range
  finder of rank 32 (doubled while too coarse) gives its dominant singular atoms, and the
  remaining directions of an orthonormal completion carry the residual, accepted only when those
  atoms' magnitudes sum to at most 5% of the top ones' (so the variance stays within that of a
  decomposition with 1.05 times the nuclear norm). A linear layer's gradient has rank at most the
  samples in the batch, which the sketch captures whole, so each rank is first tried without a
  power iteration (two fifths of the products) and then with one: on a 512 x 3072 layer (batch
  32) the atoms cost 7.2 ms instead of 64 ms on one CPU thread, with the same variance. A sketch
  writes its coordinates to a buffer kept per shape (a fresh ``(m, n)`` tensor's first touch cost more than the
  product that fills it) and keeps its basis in factors, out of which only the atoms drawn are formed
  (:class:`~lightning_gradcomp.core.compressors.spectral.SketchedAtoms`). Other layers, and
  ``decomposition="full"``, take the exact decomposition (the authors' full SVD, computed through
  the Gram matrix).
* **Matrix view**: a tensor of shape ``(out, d1, d2, ...)`` becomes ``(out, d1 * d2 * ...)``:
  convolutions ``(out, in, kh, kw) -> (out, in*kh*kw)``, linear weights stay ``(out, in)`` (the
  view PyTorch's PowerSGD hook uses). The authors reshape a convolution ``(a, b, c, d)`` to
  ``(a*b/2, 2*c*d)``: a tall matrix of rank at most ``2cd`` (18 for 3x3 kernels), needing an even
  ``a*b``. Per atom the two views cost ``m + n + 1`` numbers: 641 here against 2,067 for a
  64x64x3x3 kernel, 161 against 147 for a 16x16x3x3 one, so for wide layers this view sends about
  3x fewer numbers per atom; its rank can be higher (up to ``out``), so with the same budget the
  mass is spread over more atoms and the variance per kept atom can be larger.
* **Dense fallback**: 1-D tensors (biases, norms) and flat vectors (``granularity="model"`` or ``"group"``)
  have no matrix structure; they travel dense, as the paper prescribes for 1-D tensors, inside
  the ATOMO payload format (a :class:`~lightning_gradcomp.core.compressors.DensePayload`). So do
  matrices for which the expected spectral payload would not be smaller than the dense tensor
  (``min(s, min(m, n)) (m + n + 1) * 4 >= m n * itemsize``, e.g. a ``(2, 1000)`` logits layer).
  The choice depends only on the shape and dtype, which every rank knows, so the wire form needs
  no flag. ATOMO with a flat unit therefore compresses nothing: use ``"layer"``.
* **Precision**: the SVD runs in float32 for float32, float16 and bfloat16 gradients (float64
  for float64 ones), and ``u``, ``v`` and ``sigma / p`` travel in that precision: ``sigma / p``
  can exceed the float16 range even when every gradient entry fits, and 16-bit singular vectors
  would add error the variance analysis does not account for. The decompressed sum is cast to
  the gradient's dtype when added.
* **Non-finite gradients** (an fp16 overflow step under a ``GradScaler``): the SVD cannot run, so
  the payload is one atom with a NaN coefficient; it decompresses to an all-NaN layer, and the
  scaler sees the overflow and skips the step, as it would under plain DDP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_gradcomp.core.compressors.base import Compressor, Payload, all_finite
from lightning_gradcomp.core.compressors.draws import Draws, uniform
from lightning_gradcomp.core.compressors.identity import DensePayload
from lightning_gradcomp.core.compressors.sparse import itemsize
from lightning_gradcomp.core.compressors.spectral import (
    DenseAtoms,
    SketchedAtoms,
    TransposedAtoms,
    sketched_atoms,
    spectral_decomposition,
)
from lightning_gradcomp.core.compressors.wire import ByteReader, to_bytes
from lightning_gradcomp.core.validation import check_choice, check_int, check_number

#: ``decomposition`` choices of :class:`AtomoCompressor`
DECOMPOSITIONS = ("sketched", "full")
#: a sketch is kept when its residual atoms' magnitudes sum to at most this fraction of the top atoms'
SKETCH_SLACK = 0.05
#: power iterations each sketch rank tries, in order: none is exact for a gradient of rank <= the sketch's
SKETCH_POWER_ITERATIONS = (0, 1)
#: seed of the sketches' Gaussian test matrices (fixed: the same gradient always gets the same atoms)
SKETCH_SEED = 0x5EED


def validate_budget(budget: float) -> float:
    """``budget`` (the expected number of atoms ``s``) as a float; ``ValueError`` unless it is finite and > 0."""
    return check_number("budget", budget, 0, open_min=True, note="expected atoms per layer")


def atomo_probabilities(magnitudes: Tensor, budget: float) -> Tensor:
    """Variance-optimal sampling probabilities of ATOMO (Wang et al., NeurIPS 2018, Sec. 3, Algorithm 1).

    Solves ``min sum_i lambda_i^2 / p_i`` subject to ``sum_i p_i = s`` and ``0 < p_i <= 1`` over the
    nonzero ``lambda_i`` (``p_i = 0`` where ``lambda_i = 0``: such atoms carry nothing). When ``s``
    is at least the number ``r`` of nonzero magnitudes, every nonzero atom is kept (``p_i = 1``,
    sum ``r``). Otherwise the sum is exactly ``s``.

    The optimum (KKT conditions of the convex problem) is ``p_i = min(1, c |lambda_i|)`` for the
    one ``c > 0`` that spends the budget. Algorithm 1 finds it by water-filling: with the
    magnitudes sorted in decreasing order ``a_1 >= a_2 >= ...`` and ``k`` atoms already set to
    ``p = 1``, the remaining budget ``s - k`` is spread proportionally over the tail,
    ``p_j = a_j (s - k) / T_k`` with ``T_k = sum_{j > k} a_j``, provided the largest of them fits,
    ``a_{k+1} (s - k) <= T_k``; otherwise atom ``k + 1`` is set to 1 and the test repeats. The
    test is monotone in ``k`` (once it holds it holds for every larger ``k``) and holds at the
    latest for ``k = ceil(s) - 1``, so the stopping ``k`` is the first index where it holds:
    one sort, one reversed cumulative sum for all ``T_k`` and one ``argmax`` replace the loop.

    Args:
        magnitudes: the coefficients ``lambda_i`` in any order (signs are ignored), 1-D.
        budget: the expected number of atoms ``s > 0`` (need not be an integer).

    Returns:
        ``p`` with the shape, order, dtype and device of ``magnitudes``.
    """
    budget = validate_budget(budget)
    if magnitudes.dim() != 1:
        raise ValueError(f"magnitudes must be 1-D, got shape {tuple(magnitudes.shape)}")
    a = magnitudes.abs()
    nonzero = int(torch.count_nonzero(a))
    if budget >= nonzero:
        return (a > 0).to(a.dtype)
    ordered, order = torch.sort(a, descending=True)
    tails = ordered.flip(0).cumsum(0).flip(0)  # tails[k] = sum_{j >= k} ordered[j] (0-based: k atoms saturated)
    saturated = torch.arange(ordered.numel(), device=a.device, dtype=a.dtype)
    fits = ordered * (budget - saturated) <= tails
    k = int(torch.argmax(fits.to(torch.uint8)))  # first True; exists for k = ceil(s) - 1 < r
    scale = (budget - k) / tails[k]
    p_sorted = torch.where(saturated < k, torch.ones_like(ordered), (ordered * scale).clamp(max=1.0))
    return torch.empty_like(a).scatter_(0, order, p_sorted)


def one_pass_probabilities(magnitudes: Tensor, budget: float) -> Tensor:
    """The authors' shortcut, for comparison only: ``p_i = min(1, s |lambda_i| / sum_j |lambda_j|)``.

    This is what the ATOMO authors' code computes in one pass (no water-filling). Clipping at 1
    discards budget without redistributing it, so ``sum p < s`` whenever an atom is clipped and
    the variance is never below that of :func:`atomo_probabilities`. Not used by the compressor.
    """
    budget = validate_budget(budget)
    a = magnitudes.abs()
    total = a.sum()
    if total == 0:
        return torch.zeros_like(a)
    return (a * (budget / total)).clamp(max=1.0)


def sampling_variance(magnitudes: Tensor, probabilities: Tensor) -> Tensor:
    """``E||g_hat - g||^2 = sum_i lambda_i^2 (1/p_i - 1)`` over the nonzero ``lambda_i`` (Wang et al., Sec. 3).

    The atoms being orthonormal, this is the exact variance of the sparsified estimate; for
    spectral atoms ``||u_i v_i^T||_F = 1``.
    """
    a2 = magnitudes.abs().pow(2)
    keep = a2 > 0
    return (a2[keep] * (1.0 / probabilities[keep] - 1.0)).sum()


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision of the SVD and of the atoms on the wire: float64 for float64 gradients, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class AtomoPayload(Payload):
    """``k`` rank-1 atoms of an ``(m, n)`` matrix view of a tensor of ``shape``.

    Decompresses to ``sum_i coefficients[i] * outer(u[i], v[i])`` with ``coefficients = sigma / p``.
    Wire form: ``u`` (``k x m``), then ``v`` (``k x n``), then the coefficients (``k``), all in
    :func:`wire_dtype` of the gradient's dtype: ``k (m + n + 1) * 4`` bytes for 32/16-bit
    gradients. ``k`` follows from the buffer's length and ``(m, n)``.
    """

    u: Tensor
    v: Tensor
    coefficients: Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.coefficients.device

    @property
    def atoms(self) -> int:
        """Number of atoms carried."""
        return self.coefficients.numel()

    @property
    def nbytes(self) -> int:
        return (self.u.numel() + self.v.numel() + self.coefficients.numel()) * self.coefficients.element_size()

    def to_bytes(self) -> Tensor:
        return to_bytes([self.u, self.v, self.coefficients])

    @classmethod
    def from_bytes(cls, buffer: Tensor, shape: torch.Size, dtype: torch.dtype, matrix: tuple[int, int]) -> AtomoPayload:
        """Parse the wire form of a tensor of ``shape`` and ``dtype`` viewed as the ``matrix`` ``(m, n)``."""
        m, n = matrix
        atom_dtype = wire_dtype(dtype)
        per_atom = (m + n + 1) * itemsize(atom_dtype)
        if buffer.numel() % per_atom:
            raise ValueError(
                f"ATOMO payload of {buffer.numel()} bytes is not a whole number of {per_atom}-byte atoms "
                f"for a ({m}, {n}) matrix"
            )
        k = buffer.numel() // per_atom
        reader = ByteReader(buffer)
        u = reader.take(k * m, atom_dtype).view(k, m)
        v = reader.take(k * n, atom_dtype).view(k, n)
        coefficients = reader.take(k, atom_dtype)
        return cls(u, v, coefficients, shape, dtype)

    def dense(self) -> Tensor:
        """The ``(m, n)`` matrix ``sum_i c_i u_i v_i^T`` in the wire precision."""
        return self.u.T @ (self.coefficients[:, None] * self.v)


class AtomoCompressor(Compressor):
    """Spectral ATOMO (Wang et al., NeurIPS 2018, Sec. 5): sample rank-1 SVD atoms with variance-optimal probabilities.

    Each compressed tensor is viewed as an ``(m, n)`` matrix (``(out, prod(rest))``), decomposed
    ``G = sum_i sigma_i u_i v_i^T`` (:func:`spectral_decomposition`), and atom ``i``
    is kept with probability ``p_i`` from :func:`atomo_probabilities` (expected count
    ``min(s, rank)``), scaled by ``1 / p_i``: ``E[decompress(compress(G))] = G``. The number of
    atoms varies from draw to draw and from rank to rank, so payload sizes are exchanged
    (:meth:`payload_nbytes` is ``None``) and the payloads are all-gathered. 1-D tensors, flat
    vectors and matrices too small to gain travel dense (module docstring).

    Args:
        budget: the sparsity budget ``s``, the expected number of atoms per layer (> 0; the
            authors used 3 for ResNet-18 on CIFAR-10).
        decomposition: ``"sketched"`` (default) tries a randomized rank-``sketch_rank`` sketch,
            doubling the rank while its residual atoms carry too much (their magnitudes' sum above
            :data:`SKETCH_SLACK` of the top atoms'), and decomposes exactly once the rank would reach
            a quarter of the smaller side; ``"full"`` always decomposes exactly. Both are unbiased
            (:mod:`~lightning_gradcomp.core.compressors.spectral`); an accepted sketch's variance is at
            most that of a decomposition whose magnitudes sum to ``1 + SKETCH_SLACK`` times the
            nuclear norm. Gradients of linear layers have rank at most the tokens in the batch,
            which the default rank of 32 often covers.
        sketch_rank: the first rank tried by ``"sketched"`` (>= 1).
    """

    name = "atomo"
    unbiased = True
    needs_layer_shape = True

    def __init__(self, budget: float = 3, decomposition: str = "sketched", sketch_rank: int = 32) -> None:
        self.budget = validate_budget(budget)
        self.decomposition = check_choice("decomposition", decomposition, DECOMPOSITIONS)
        self.sketch_rank = check_int("sketch_rank", sketch_rank, 1, note="the first rank a sketch tries")
        self._test_matrices: dict[tuple[int, int, torch.dtype, torch.device], Tensor] = {}
        self._workspaces: dict[tuple[int, int, torch.dtype, torch.device], Tensor] = {}

    def matrix_shape(self, shape: torch.Size, dtype: torch.dtype) -> tuple[int, int] | None:
        """The ``(m, n)`` view a tensor of ``shape`` is decomposed as, or ``None`` when it travels dense.

        ``(shape[0], numel / shape[0])`` for tensors of two or more dimensions, unless the
        expected spectral payload ``min(s, min(m, n)) (m + n + 1)`` wire numbers is at least the
        dense tensor's size in bytes.
        """
        if len(shape) < 2:
            return None
        m = shape[0]
        n = shape.numel() // m if m else 0
        expected = min(self.budget, min(m, n)) * (m + n + 1) * itemsize(wire_dtype(dtype))
        if expected >= m * n * itemsize(dtype):
            return None
        return m, n

    def decompose(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``U, S, Vh`` of ``x``'s matrix view, in :func:`wire_dtype` (requires a matrix-shaped ``x``).

        Orthonormal atoms that sum to the matrix (``decomposition``); the same ``x`` always gets the
        same atoms: the sketches' test matrices are drawn once, from a fixed seed.
        """
        return self._decompose(x, reuse=False).dense()

    def _decompose(self, x: Tensor, reuse: bool) -> DenseAtoms | SketchedAtoms | TransposedAtoms:
        """:meth:`decompose`'s atoms, a sketch's in factors (only the atoms kept are formed); with ``reuse`` a
        sketch's coordinates fill a buffer kept per shape (valid until the next call)."""
        matrix = self.matrix_shape(x.shape, x.dtype)
        if matrix is None:
            raise ValueError(f"a tensor of shape {tuple(x.shape)} and {x.dtype} travels dense; it has no ATOMO atoms")
        a = x.detach().reshape(matrix).to(wire_dtype(x.dtype))
        wide = a.shape[0] <= a.shape[1]
        side = a if wide else a.T
        rank = self.sketch_rank
        while self.decomposition == "sketched" and 4 * rank <= side.shape[0]:
            for power_iterations in SKETCH_POWER_ITERATIONS:
                atoms = sketched_atoms(
                    side,
                    self._test_matrix(side, rank),
                    SKETCH_SLACK,
                    power_iterations,
                    self._workspace(side) if reuse else None,
                )
                if atoms is not None:
                    return atoms if wide else TransposedAtoms(atoms)
            rank *= 2
        return DenseAtoms(*spectral_decomposition(a))

    def _test_matrix(self, side: Tensor, rank: int) -> Tensor:
        """The ``(n, rank)`` Gaussian test matrix of a sketch, drawn once per shape from a fixed seed."""
        key = (side.shape[1], rank, side.dtype, side.device)
        if key not in self._test_matrices:
            gen = torch.Generator().manual_seed(SKETCH_SEED)
            self._test_matrices[key] = torch.randn(key[:2], generator=gen, dtype=side.dtype).to(side.device)
        return self._test_matrices[key]

    def _workspace(self, side: Tensor) -> Tensor:
        """The ``(m, n)`` buffer that sketches of the wide ``side`` write their coordinates into."""
        key = (*side.shape, side.dtype, side.device)
        if key not in self._workspaces:
            self._workspaces[key] = torch.empty(side.shape, dtype=side.dtype, device=side.device)  # row-major
        return self._workspaces[key]

    def probabilities(self, singular_values: Tensor) -> Tensor:
        """Keep-probabilities of the atoms (float64): :func:`atomo_probabilities` with this budget."""
        return atomo_probabilities(singular_values.double(), self.budget)

    def compress(self, x: Tensor, generator: Draws = None, scale: Tensor | None = None) -> AtomoPayload | DensePayload:
        matrix = self.matrix_shape(x.shape, x.dtype)
        if matrix is None:
            return DensePayload(x.reshape(-1), x.shape)
        m, n = matrix
        atom_dtype = wire_dtype(x.dtype)
        if not all_finite(x) and not bool(torch.isfinite(x).all()):  # one sum; a mask only if it overflows
            nan = torch.full((1,), math.nan, dtype=atom_dtype, device=x.device)
            ones = (
                torch.ones((1, m), dtype=atom_dtype, device=x.device),
                torch.ones((1, n), dtype=atom_dtype, device=x.device),
            )
            return AtomoPayload(ones[0], ones[1], nan, x.shape, x.dtype)
        atoms = self._decompose(x, reuse=True)
        sigma = atoms.sigma
        p = self.probabilities(sigma)
        draws = uniform(generator, p.numel(), p.device, p.dtype).view(p.shape)
        kept = torch.nonzero(draws < p).reshape(-1)  # p = 0 (sigma = 0) is never kept, p = 1 always
        coefficients = (sigma[kept].double() / p[kept]).to(atom_dtype)
        return AtomoPayload(*atoms.rows(kept), coefficients, x.shape, x.dtype)  # the kept atoms alone, formed anew

    def unpack(self, buffer: Tensor, shape: torch.Size, dtype: torch.dtype) -> AtomoPayload | DensePayload:
        matrix = self.matrix_shape(shape, dtype)
        if matrix is None:
            return DensePayload(ByteReader(buffer).take(shape.numel(), dtype), shape)
        return AtomoPayload.from_bytes(buffer, shape, dtype, matrix)

    def accumulate(self, payload: Payload, out: Tensor) -> Tensor:
        if isinstance(payload, DensePayload):
            return out.add_(payload.values)
        assert isinstance(payload, AtomoPayload)
        if not payload.atoms:
            return out
        if out.dtype == payload.coefficients.dtype and out.is_contiguous():
            m, n = payload.u.shape[1], payload.v.shape[1]
            out.view(m, n).addmm_(payload.u.T, payload.coefficients[:, None] * payload.v)  # no dense temporary
            return out
        return out.add_(payload.dense().reshape(-1).to(out.dtype))

    def payload_nbytes(self, shape: torch.Size, dtype: torch.dtype) -> int | None:
        """Dense tensors have a fixed size; spectral payloads vary with the atoms drawn (``None``)."""
        if self.matrix_shape(shape, dtype) is None:
            return shape.numel() * itemsize(dtype)
        return None

    def preferred_aggregator(self, world_size: int) -> str:
        """``"allgather"``: summing decompressed matrices with allreduce would send them dense."""
        return "allgather"
