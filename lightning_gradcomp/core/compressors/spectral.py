"""Orthonormal rank-one atoms of a matrix, ``A = sum_i sigma_i u_i v_i^T``, for spectral ATOMO.

ATOMO's estimator (Wang et al., NeurIPS 2018, Sec. 3) is unbiased for ANY orthonormal atomic
decomposition: with ``U`` an orthonormal basis of the smaller side, ``A = U (U^T A)`` is a sum of
the orthonormal atoms ``u_i (u_i^T A)``, and keeping atom ``i`` with probability ``p_i``, scaled by
``1 / p_i``, averages to ``A``. The basis only sets the variance, ``(sum_i sigma_i)^2 / s - ||A||^2``
at the optimal probabilities (no atom saturated), which is smallest when ``sum_i sigma_i`` is the
nuclear norm: the singular value decomposition (Sec. 5).

Two ways to build such a basis, one job each:

* :func:`spectral_decomposition`: the exact singular atoms, through the eigenvectors of the Gram
  matrix of the smaller side (``O(m^2 n + m^3)``).
* :func:`sketched_atoms`: a randomized range finder (Halko, Martinsson and Tropp, SIAM
  Review 2011, Alg. 4.1, or Alg. 4.4 with power iterations) finds the ``r`` dominant left directions; their
  Householder reflectors complete them to an orthonormal basis of the whole side, applied in the
  compact WY form ``H = I - V T V^T`` (Joffrain et al., ACM TOMS 2006): ``O(m n r)`` for a rank-``r``
  sketch. The top ``r`` coordinates are decomposed exactly; each remaining basis direction is one
  atom of the residual. It is accepted only when those residual atoms' magnitudes sum to at most
  ``slack`` times the top ones', which keeps ``sum_i sigma_i`` within ``1 + slack`` of the nuclear
  norm (the top ones' sum never exceeds it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def spectral_decomposition(matrix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``U, S, Vh`` with ``matrix = U diag(S) Vh``, ``S`` descending, through the Gram matrix of the smaller side.

    For a wide ``(m, n)`` matrix ``A`` (``m <= n``): the eigenvectors ``U`` of ``A A^T`` (``m x m``,
    ``torch.linalg.eigh``) form an orthonormal basis, so ``A = U (U^T A)`` exactly, whatever the
    accuracy of the eigenvalues; row ``i`` of ``B = U^T A`` is ``sigma_i v_i^T`` with
    ``sigma_i = ||B_i||``. A tall matrix goes through ``A^T A`` the same way. On one CPU thread a
    512 x 3072 fp32 matrix takes about 30 ms this way against 310 ms for ``torch.linalg.svd``.

    Why ATOMO stays exact: its estimator keeps atom ``u_i B_i`` with probability ``p_i`` and scales
    it by ``1 / p_i``, so ``E = sum_i u_i B_i = U U^T A = A`` needs only ``U`` orthonormal, which a
    symmetric eigensolver delivers to working precision; ``sigma_i`` is read off ``B`` (absolute
    error about ``eps * ||A||``, as an SVD's), not from the squared eigenvalues, whose small values
    lose half their digits. A direction with ``sigma_i = 0`` has ``B_i = 0``, carries nothing, and
    gets ``v_i = 0`` and probability 0.

    Any orthonormal ``U`` keeps that identity, which is what the fallback uses: when LAPACK's
    symmetric eigensolver fails on an ill-conditioned Gram matrix (no convergence, or non-finite
    eigenvectors: both seen on LeNet-5's gradients), the basis comes from an SVD of ``A`` itself.
    (Non-finite gradients never get here: :meth:`AtomoCompressor.compress` sends them on as they are.)
    """
    m, n = matrix.shape
    wide = m <= n
    a = matrix if wide else matrix.T
    basis = _orthonormal_basis(a)
    rows = basis.T @ a  # row i: sigma_i v_i^T
    sigma = torch.linalg.vector_norm(rows, dim=1)
    order = torch.argsort(sigma, descending=True)
    basis, rows, sigma = basis[:, order], rows[order], sigma[order]
    directions = rows / torch.where(sigma > 0, sigma, 1.0).unsqueeze(1)
    if wide:
        return basis, sigma, directions
    return directions.T, sigma, basis.T


def _orthonormal_basis(a: Tensor) -> Tensor:
    """Eigenvectors of ``a a^T`` (``a`` wide), or the left singular vectors of ``a`` if the eigensolver fails.

    It fails in two ways, both seen on LeNet-5's gradients: it raises (no convergence), or, with
    MKL's solver on one thread and a rank-deficient Gram matrix (a layer with dead units), it
    returns NaN eigenvectors without raising, which would poison every rank's average.
    """
    try:
        basis = torch.linalg.eigh(a @ a.T).eigenvectors  # orthonormal, ascending eigenvalues
        if bool(torch.isfinite(basis).all()):
            return basis
    except torch.linalg.LinAlgError:
        pass
    return torch.linalg.svd(a, full_matrices=False).U


@dataclass(frozen=True)
class DenseAtoms:
    """Atoms held in full: ``matrix = u diag(sigma) vh``."""

    u: Tensor
    sigma: Tensor
    vh: Tensor

    def rows(self, kept: Tensor) -> tuple[Tensor, Tensor]:
        """The atoms ``kept`` (ascending positions): their ``u`` columns and ``vh`` rows, as rows of new tensors."""
        return self.u[:, kept].T.contiguous(), self.vh[kept].contiguous()

    def dense(self) -> tuple[Tensor, Tensor, Tensor]:
        """``u, sigma, vh``."""
        return self.u, self.sigma, self.vh


@dataclass(frozen=True)
class TransposedAtoms:
    """The atoms of ``matrix.T`` given those of ``matrix`` (a tall matrix is decomposed through its wide transpose):
    ``u`` and ``vh`` trade places."""

    atoms: DenseAtoms | SketchedAtoms

    @property
    def sigma(self) -> Tensor:
        return self.atoms.sigma

    def rows(self, kept: Tensor) -> tuple[Tensor, Tensor]:
        u_rows, vh_rows = self.atoms.rows(kept)
        return vh_rows, u_rows

    def dense(self) -> tuple[Tensor, Tensor, Tensor]:
        u, sigma, vh = self.atoms.dense()
        return vh.T, sigma, u.T


@dataclass(frozen=True)
class SketchedAtoms:
    """The atoms of a sketch (:func:`sketched_atoms`) kept in factors, so that ATOMO forms only the few it keeps.

    The basis is ``H = I - G V^T`` (``V``: the sketch's Householder vectors, ``G = V T``). Atom ``j < r`` is the top
    block's: ``u_j = H[:, :r] top_u[:, j]``, ``v_j^T = top_vh[j]``; atom ``j >= r`` is the residual's coordinate along
    ``H``'s column ``j``: ``u_j = H e_j``, ``v_j^T = C[j] / sigma_j`` with ``C = H^T A``. Forming all ``m`` columns
    of ``H`` costs an ``m x m x r`` product and all ``m - r`` residual rows a pass over ``C``; the ``s`` or so atoms
    kept cost ``m r s`` and ``n s``."""

    sigma: Tensor
    vectors: Tensor
    weights: Tensor
    top_u: Tensor
    top_vh: Tensor
    coordinates: Tensor

    def rows(self, kept: Tensor) -> tuple[Tensor, Tensor]:
        """The atoms ``kept`` (ascending positions): ``u_j`` as rows ``(k, m)`` and ``v_j^T`` as rows ``(k, n)``,
        without reading a count back (each position picks its formula by a mask)."""
        m, r = self.vectors.shape
        top = kept < r
        columns = torch.arange(kept.numel(), device=kept.device)
        # w_j: top_u's column j in the top block for j < r, e_j for j >= r; then u_j = H w_j = w_j - G (V^T w_j)
        w = torch.zeros(m, kept.numel(), dtype=self.top_u.dtype, device=self.top_u.device)
        w[:r] = self.top_u[:, kept.clamp(max=r - 1)] * top.to(w.dtype)
        w.index_put_((kept, columns), (~top).to(w.dtype), accumulate=True)
        u_rows = torch.addmm(w, self.weights, self.vectors.T @ w, alpha=-1).T.contiguous()
        sigma = self.sigma[kept]
        residual = self.coordinates[kept] / torch.where(sigma > 0, sigma, 1.0).unsqueeze(1)
        vh_rows = torch.where(top.unsqueeze(1), self.top_vh[kept.clamp(max=r - 1)], residual)
        return u_rows, vh_rows

    def dense(self) -> tuple[Tensor, Tensor, Tensor]:
        """All ``m`` atoms: ``U`` (``m x m``, orthonormal), ``S`` and ``Vh``, as new tensors."""
        m, r = self.vectors.shape
        u = torch.eye(m, dtype=self.vectors.dtype, device=self.vectors.device)
        u.addmm_(self.weights, self.vectors.T, alpha=-1)  # H
        u[:, :r] = u[:, :r] @ self.top_u
        residual_sigma = self.sigma[r:]
        below = self.coordinates[r:] / torch.where(residual_sigma > 0, residual_sigma, 1.0).unsqueeze(1)
        return u, self.sigma, torch.cat([self.top_vh, below])


def sketched_atoms(
    matrix: Tensor,
    test_matrix: Tensor,
    slack: float,
    power_iterations: int = 1,
    out: Tensor | None = None,
) -> SketchedAtoms | None:
    """The atoms of ``matrix`` from a rank-``r`` sketch, in factors (:class:`SketchedAtoms`), or ``None`` when its
    residual is too large.

    ``matrix`` is wide ``(m, n)``, ``m <= n``; ``test_matrix`` is ``(n, r)`` with ``r < m``. The sketch
    is the range of ``(A A^T)^q A Omega`` for ``q = power_iterations`` (Halko et al., Alg. 4.1 for
    ``q = 0``, Alg. 4.4 above): with ``q = 0`` it is exact, at two fifths of ``q = 1``'s products, when
    ``A`` has rank at most ``r`` (a linear layer's gradient over at most ``r`` samples). ``U`` is
    orthonormal (``m x m``) whatever the sketch's quality, so the atoms sum to ``matrix`` to working
    precision and ATOMO stays unbiased; the first ``r`` atoms are the exact singular atoms of the
    projection onto the sketched range (``S`` descending there), the other ``m - r`` are the
    residual's coordinates along the completing Householder directions (module docstring), in
    their basis order. ``None`` when those coordinates' norms sum to more than ``slack`` times the
    first ``r`` singular values' sum: the caller then sketches a larger rank or decomposes exactly.
    ``out``: an ``(m, n)`` tensor that receives ``H^T A`` (kept between calls, it spares a fresh allocation, whose
    first touch costs more than its arithmetic); the atoms read it until the next call that writes it.
    """
    m = matrix.shape[0]
    r = test_matrix.shape[1]
    sketch = matrix @ test_matrix
    for _ in range(power_iterations):
        sketch = torch.linalg.qr(sketch).Q
        sketch = matrix @ (matrix.T @ sketch)  # one power iteration: the range of (A A^T) A Omega
    reflectors, tau = torch.geqrf(sketch)
    vectors = torch.tril(reflectors, -1) + torch.eye(m, r, dtype=matrix.dtype, device=matrix.device)
    trivial = tau == 0  # H_j = I (a zero column): drop its vector so T's entry for it is never used
    vectors[:, trivial] = 0
    # H = H_1 ... H_r = I - V T V^T with T^{-1} = strict_upper(V^T V) + diag(1 / tau) (Joffrain et al., Sec. 3);
    # T itself is r x r and triangular: inverted once, it turns both applications of H into products
    t_inverse = torch.triu(vectors.T @ vectors, 1) + torch.diag(torch.where(trivial, 1.0, 1.0 / tau))
    t = torch.linalg.solve_triangular(t_inverse, torch.eye(r, dtype=matrix.dtype, device=matrix.device), upper=True)
    # H^T A = A - V T^T V^T A
    coordinates = torch.addmm(matrix, vectors @ t.T, vectors.T.contiguous() @ matrix, alpha=-1, out=out)
    residual_sigma = torch.linalg.vector_norm(coordinates[r:], dim=1)  # below the sketched directions
    top_u, top_sigma, top_vh = spectral_decomposition(coordinates[:r])
    if float(residual_sigma.sum()) > slack * float(top_sigma.sum()):
        return None
    sigma = torch.cat([top_sigma, residual_sigma])
    return SketchedAtoms(sigma, vectors, vectors @ t, top_u, top_vh, coordinates)
