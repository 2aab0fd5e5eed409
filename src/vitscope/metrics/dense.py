"""Dense downstream metrics with no training (pure functions on arrays): video object segmentation by label
propagation and its J / F scores, keypoint correspondence (PCK) and instance retrieval (revisited mAP).

Sources, re-implemented (not copied):
  * J and F: the DAVIS evaluation, ``davisvideochallenge/davis2017-evaluation``, ``davis2017/metrics.py``
    (``db_eval_iou``, ``f_measure`` / ``db_eval_boundary``, ``_seg2bmap``): J is the region IoU (1 when both
    masks are empty); F the boundary F-measure, boundaries as ``_seg2bmap`` draws them and matched within
    ``ceil(BOUND_TH * image diagonal)`` pixels (a disk), with DAVIS's conventions for empty boundaries. In
    the semi-supervised evaluation (``evaluation.py``) the true masks are ``labels == id`` per object, so void
    pixels (255) count as background (`jf_objects`).
  * Propagation: DINO's ``eval_video_segmentation.py`` (Caron et al., 2021; ``label_propagation``,
    ``restrict_neighborhood``, ``norm_mask``): affinity ``exp(cos / 0.1)`` between the target frame's patch
    tokens and the context frames' (first frame + the last 7), restricted to a square neighbourhood of
    radius 12 tokens, the top 5 kept per target token (ties at the 5th value kept, as DINO's threshold does),
    normalised; labels are the affinity-weighted sum of the context's token labels; bilinear upsampling to
    pixels, per-channel min-max normalisation, argmax.
  * mAP: the revisited Oxford / Paris protocol (Radenović et al., "Revisiting Oxford and Paris: Large-Scale
    Image Retrieval Benchmarking", CVPR 2018; ``filipradenovic/revisitop``, ``python/evaluate.py``
    ``compute_map`` / ``compute_ap``): junk images are removed from the ranking before AP, AP is the
    trapezoid rule over recall steps, queries without positives are left out of the mean; Easy = easy
    positives (hard and junk ignored), Medium = easy + hard (junk ignored), Hard = hard (easy and junk ignored).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vitscope.host import reads_are_free

#: DAVIS boundary tolerance: a fraction of the image diagonal (davis2017-evaluation ``bound_th=0.008``)
BOUND_TH = 0.008
#: DINO's propagation protocol (``eval_video_segmentation.py`` defaults)
N_LAST_FRAMES = 7
NEIGHBOURHOOD = 12
TOPK = 5
TEMPERATURE = 0.1
#: DAVIS label value for pixels that are ignored (not an object, not background)
VOID = 255
#: propagation holds at most about this many affinity entries at once (queries are chunked beyond it)
AFFINITY_CHUNK = 1 << 24
#: PCK thresholds, fractions of max(bbox h, w) of the target object
PCK_ALPHAS = (0.1, 0.05, 0.01)
#: the base of the per-image seeds of the Gaussian "random" features (`gaussian_features`)
RANDOM_FEATURE_SEED = 20230618


# ------------------------------------------------------------------------------------------------ J and F


def jaccard(gt: np.ndarray | torch.Tensor, pred: np.ndarray | torch.Tensor,
            void: np.ndarray | torch.Tensor | None = None) -> float:
    """Region similarity J: |gt & pred| / |gt | pred| over non-void pixels; 1 when both are empty."""
    gt, pred = torch.as_tensor(np.asarray(gt)).bool(), torch.as_tensor(np.asarray(pred)).bool()
    keep = torch.ones_like(gt) if void is None else ~torch.as_tensor(np.asarray(void)).bool()
    inter = int((gt & pred & keep).sum())
    union = int(((gt | pred) & keep).sum())
    return 1.0 if union == 0 else inter / union


def boundary_map(masks: torch.Tensor) -> torch.Tensor:
    """(..., H, W) bool -> (..., H, W) bool one-pixel boundaries as DAVIS's ``_seg2bmap`` draws them: pixel p is
    on the boundary when the 2x2 block it starts (p, right, below, below-right; the image's last row and
    column repeated past the edge) is not constant."""
    c = masks.bool()
    e = torch.cat([c[..., :, 1:], c[..., :, -1:]], -1)
    s = torch.cat([c[..., 1:, :], c[..., -1:, :]], -2)
    se = torch.cat([e[..., 1:, :], e[..., -1:, :]], -2)
    return (c ^ e) | (c ^ s) | (c ^ se)


def disk(radius: int) -> torch.Tensor:
    """(2r+1, 2r+1) bool disk: x^2 + y^2 <= r^2 (skimage.morphology.disk)."""
    r = int(radius)
    y, x = torch.meshgrid(torch.arange(-r, r + 1), torch.arange(-r, r + 1), indexing="ij")
    return (x * x + y * y) <= r * r


def _dilate(b: torch.Tensor, radius: int) -> torch.Tensor:
    """Binary dilation of (..., H, W) by `disk(radius)` (outside the image adds nothing), exact: the disk is
    the union over rows dy of horizontal runs |dx| <= isqrt(r^2 - dy^2), so the map is first dilated
    horizontally by every half-width 0..r (two shifted ORs each), then each row offset ORs the dilation of its
    half-width shifted by dy: 4r + 1 ORs instead of one per disk offset (~pi r^2)."""
    r = int(radius)
    b = b.bool()
    if r <= 0:
        return b
    H, W = b.shape[-2:]
    pad = F.pad(b.to(torch.uint8), (r, r)).bool()                                     # columns padded
    runs = [b]
    for a in range(1, r + 1):
        runs.append(runs[-1] | pad[..., r - a:r - a + W] | pad[..., r + a:r + a + W])
    out = runs[r].clone()                                                              # dy = 0
    for dy in range(1, min(r, H - 1) + 1):
        run = runs[math.isqrt(r * r - dy * dy)]
        out[..., dy:, :] |= run[..., :H - dy, :]
        out[..., :H - dy, :] |= run[..., dy:, :]
    return out


def bound_pixels(height: int, width: int, bound_th: float = BOUND_TH) -> int:
    """The matching tolerance in pixels: ``bound_th`` itself when >= 1, else ceil(bound_th * diagonal)."""
    return int(bound_th) if bound_th >= 1 else int(math.ceil(bound_th * math.hypot(height, width)))


def _f_score(n_fg: torch.Tensor, n_gt: torch.Tensor, fg_match: torch.Tensor, gt_match: torch.Tensor) -> torch.Tensor:
    """F from boundary pixel counts, with davis2017-evaluation's conventions for empty boundaries."""
    n_fg, n_gt = n_fg.double(), n_gt.double()
    precision = torch.where(n_fg > 0, fg_match.double() / n_fg.clamp(min=1), torch.ones_like(n_fg))
    recall = torch.where(n_gt > 0, gt_match.double() / n_gt.clamp(min=1), torch.ones_like(n_gt))
    precision = torch.where((n_fg > 0) & (n_gt == 0), torch.zeros_like(precision), precision)
    s = precision + recall
    return torch.where(s > 0, 2 * precision * recall / s.clamp(min=1e-300), torch.zeros_like(s))


def boundary_f_batch(gt: torch.Tensor, pred: torch.Tensor, void: torch.Tensor | None = None,
                     bound_th: float = BOUND_TH) -> torch.Tensor:
    """F of each of N mask pairs (N, H, W) -> (N,) float64, as `boundary_f`."""
    gt, pred = gt.bool(), pred.bool()
    if void is not None:
        gt, pred = gt & ~void.bool(), pred & ~void.bool()
    r = bound_pixels(gt.shape[-2], gt.shape[-1], bound_th)
    bg, bp = boundary_map(gt), boundary_map(pred)
    return _f_score(bp.flatten(1).sum(1), bg.flatten(1).sum(1), (bp & _dilate(bg, r)).flatten(1).sum(1),
                    (bg & _dilate(bp, r)).flatten(1).sum(1))


def boundary_f(gt: np.ndarray | torch.Tensor, pred: np.ndarray | torch.Tensor,
               void: np.ndarray | torch.Tensor | None = None, bound_th: float = BOUND_TH) -> float:
    """Boundary F-measure of a predicted mask against the ground truth (davis2017-evaluation ``f_measure``):
    precision = predicted boundary pixels within the tolerance of a true one, recall the converse; no
    predicted boundary: precision 1, recall 0 (both 1 when neither has one); no true boundary: precision 0,
    recall 1."""
    gt = torch.as_tensor(np.asarray(gt))[None]
    pred = torch.as_tensor(np.asarray(pred))[None]
    v = None if void is None else torch.as_tensor(np.asarray(void))[None]
    return float(boundary_f_batch(gt, pred, v, bound_th)[0])


def jaccard_batch(gt: torch.Tensor, pred: torch.Tensor, void: torch.Tensor | None = None) -> torch.Tensor:
    """J of each of N mask pairs (N, H, W) -> (N,) float64."""
    gt, pred = gt.bool(), pred.bool()
    if void is not None:
        gt, pred = gt & ~void.bool(), pred & ~void.bool()
    inter = (gt & pred).flatten(1).sum(1).double()
    union = (gt | pred).flatten(1).sum(1).double()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def _object_index(labels: torch.Tensor, object_ids: Sequence[int]) -> torch.Tensor:
    """Integer label maps -> int64 maps of 1 + the position of the label in ``object_ids``, 0 for any other
    value (background, void)."""
    out = torch.zeros(labels.shape, dtype=torch.long, device=labels.device)
    for k, v in enumerate(object_ids, start=1):
        out.masked_fill_(labels == v, k)
    return out


def _count(maps: torch.Tensor) -> torch.Tensor:
    """True pixels of each (..., H, W) bool map, int64 (an int32 sum of the bytes: half the time of
    ``count_nonzero`` on the CPU; exact below 2^31 pixels)."""
    return maps.flatten(-2).view(torch.uint8).sum(-1, dtype=torch.int32).long()


def jf_objects(gt_labels: torch.Tensor, pred_labels: torch.Tensor, object_ids: Sequence[int],
               bound_th: float = BOUND_TH, pred_index: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """J and F of each object for N predicted label maps of one frame, as the DAVIS semi-supervised evaluation
    scores them (davis2017-evaluation ``_evaluate_semisupervised``: each object's true mask is ``labels ==
    id``, so `VOID` (255) pixels count as background: a prediction there is a false positive, none is
    needed; the void mask it builds from those binary masks is empty).

    gt_labels: (H, W) integer ids (0 background, `VOID` = background); pred_labels: (N, H, W) (e.g. one per
    layer), or with ``pred_index`` the maps of 1 + each object's position in ``object_ids`` (0: none), as
    `tokens_to_labels` gives them. Returns (J, F), each (N, K) float64 for the K ``object_ids``, on the
    predictions' device. Tensor ops only, nothing read back (no output whose size depends on the values): the
    confusion counts by ``scatter_add_``, the boundaries matched by dilating whole maps (`_dilate`; the true
    masks' once for all N predictions). True labels on the host go to the device without a stream
    synchronisation (``non_blocking``: a pageable source is staged at once)."""
    K, N = len(object_ids), pred_labels.shape[0]
    gi = _object_index(gt_labels.to(pred_labels.device, non_blocking=True), object_ids)  # 0: no object
    pi = pred_labels.long() if pred_index else _object_index(pred_labels, object_ids)
    # J from one confusion count per map: entry (g, p) = pixels of true index g predicted as p
    cells = pi.flatten(1) + ((K + 1) * gi).flatten()[None]
    conf = torch.zeros(N, (K + 1) ** 2, dtype=torch.long, device=pi.device)
    conf.scatter_add_(1, cells, torch.ones_like(cells))
    conf = conf.view(N, K + 1, K + 1).double()
    inter = conf.diagonal(dim1=1, dim2=2)[:, 1:]
    union = conf.sum(2)[:, 1:] + conf.sum(1)[:, 1:] - inter
    j = torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))
    r = bound_pixels(gt_labels.shape[-2], gt_labels.shape[-1], bound_th)
    ks = torch.arange(1, K + 1, device=pi.device)
    bg = boundary_map(gi[None] == ks[:, None, None])                                     # (K, H, W)
    bp = boundary_map(pi[:, None] == ks[None, :, None, None])                            # (N, K, H, W)
    fg_match = _count(bp & _dilate(bg, r)[None])
    gt_match = _count(bg[None] & _dilate(bp, r))
    f = _f_score(_count(bp), _count(bg)[None].expand(N, -1), fg_match,
                 gt_match)
    return j, f


# ------------------------------------------------------------------------------------------------ propagation


def label_presence(labels: torch.Tensor) -> torch.Tensor:
    """(257,) int64: entry v is 1 when the label value v (0 .. 255) occurs in ``labels``, entry 256 when a value
    outside 0 .. 255 does. A fixed-size answer (unlike ``torch.unique``), so several maps' can be read back in
    one copy; `present_objects` turns it into object ids."""
    v = labels.flatten().long()
    out = torch.zeros(257, dtype=torch.long, device=v.device)
    return out.scatter_(0, torch.where((v >= 0) & (v < 256), v, torch.full_like(v, 256)), 1)


def present_objects(presence: Sequence[int]) -> list[int] | None:
    """The object ids (neither background 0 nor `VOID`) a `label_presence` read back says occur, ascending; None
    when a value outside 0 .. 255 occurs (the caller then reads the map's values itself)."""
    if presence[256]:
        return None
    return [v for v in range(1, 256) if presence[v] and v != VOID]


def neighbourhood(grid: tuple[int, int], radius: int = NEIGHBOURHOOD, device: torch.device | str = "cpu"
                  ) -> torch.Tensor:
    """(S, S) bool on ``device``: key token within ``radius`` rows and columns of the query token (a square
    window, as DINO's ``restrict_neighborhood``); radius <= 0: everything."""
    h, w = grid
    i, j = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    i, j = i.flatten(), j.flatten()
    if radius <= 0:
        return torch.ones(h * w, h * w, dtype=torch.bool, device=device)
    return ((i[:, None] - i[None]).abs() <= radius) & ((j[:, None] - j[None]).abs() <= radius)


def labels_to_tokens(labels: torch.Tensor, grid: tuple[int, int], object_ids: Sequence[int]) -> torch.Tensor:
    """(H, W) integer labels -> (C, S) one-hot token labels, C = 1 + len(object_ids) (channel 0: background;
    anything not an object, void included, counts as background). Nearest-neighbour downsampling (pixel
    centre), as DINO reads the first frame's mask at the token grid."""
    h, w = grid
    H, W = labels.shape[-2:]
    rows = torch.clamp(((torch.arange(h, device=labels.device) + 0.5) * H / h).long(), max=H - 1)
    cols = torch.clamp(((torch.arange(w, device=labels.device) + 0.5) * W / w).long(), max=W - 1)
    small = labels[rows][:, cols].flatten()
    out = torch.zeros(1 + len(object_ids), h * w, device=labels.device)
    out[0] = 1.0
    for c, k in enumerate(object_ids, start=1):
        hit = small == k
        out[c, hit], out[0, hit] = 1.0, 0.0
    return out


def propagate(target: torch.Tensor, context: torch.Tensor, context_labels: torch.Tensor, grid: tuple[int, int],
              radius: int = NEIGHBOURHOOD, topk: int = TOPK, temperature: float = TEMPERATURE,
              near: torch.Tensor | None = None) -> torch.Tensor:
    """Token labels of a target frame from its context frames (DINO's ``label_propagation``), for L feature
    sets at once (e.g. layers).

    target: (L, S, D) and context: (L, n, S, D) L2-normalised patch features, tokens in row-major order on
    ``grid`` (h, w); context_labels: (L, n, C, S) soft token labels. Returns (L, C, S): per target token, the
    affinity-weighted labels of its top-k context tokens among those within ``radius`` rows and columns
    (`neighbourhood`; radius <= 0: all), affinity exp(cos / temperature), every key tied with the k-th largest
    kept (DINO's threshold).

    Only the neighbourhood is computed: queries go in bands of rows, each against the key rows within
    ``radius`` of the band (one contiguous slice of every context frame), so the affinity costs about
    (band + 2 radius) / h of DINO's full S x n S product, which it then masks; a wide frame is best passed
    transposed (grid (w, h), tokens column-major), as `Propagation` does. ``context`` is cheapest as a view of
    an (L, S, n, D) tensor (``torch.stack(frames, 2).transpose(1, 2)``; otherwise it is copied into that
    layout once), ``near`` the `neighbourhood` of ``grid`` and ``radius`` when the caller keeps it."""
    L, n, S, _ = context.shape
    h, w = grid
    if S != h * w or target.shape[1] != S:
        raise ValueError(f"propagate: {S} context and {target.shape[1]} target tokens on a {h}x{w} grid")
    r = radius if radius > 0 else h
    near = neighbourhood(grid, radius, target.device) if near is None else near.to(target.device)
    keys_all = context.transpose(1, 2).contiguous()                                 # (L, S, n, D): a band's
    labels = context_labels.permute(0, 3, 1, 2)                                     # keys are one slice
    # rows per band: small against the radius (little key waste), capped so one band's affinity stays near
    # AFFINITY_CHUNK entries
    band = max(1, min(h, max(1, r // 2), AFFINITY_CHUNK // max(1, L * n * w * w * min(h, 2 * r + 1))))
    out = []
    for r0 in range(0, h, band):
        r1 = min(h, r0 + band)
        k0, k1 = max(0, r0 - r), min(h, r1 + r)
        q, K = (r1 - r0) * w, (k1 - k0) * w
        keys = keys_all[:, k0 * w:k1 * w].reshape(L, K * n, -1)                      # (L, K n, D), a view
        # -inf outside the neighbourhood, added by the product itself (exact: x + 0 = x)
        far = torch.zeros(q, K, n, dtype=target.dtype, device=target.device)
        far.masked_fill_(~near[r0 * w:r1 * w, k0 * w:k1 * w, None], -math.inf)
        sim = torch.baddbmm(far.view(q, K * n), target[:, r0 * w:r1 * w], keys.transpose(1, 2))  # (L, q, K n)
        lab = labels[:, k0 * w:k1 * w].reshape(L, K * n, -1)                         # (L, K n, C)
        k = min(topk, n * K)
        # the k largest and one more: exp((cos - max) / T) is DINO's exp(cos / T) up to a per-query factor
        # that the normalisation removes, and is computed for the k kept keys only
        vals, idx = torch.topk(sim, min(k + 1, n * K), dim=-1)
        wts = torch.exp((vals[..., :k] - vals[..., :1]) / temperature)
        got = torch.gather(lab, 1, idx[..., :k].reshape(L, q * k, 1).expand(-1, -1, lab.shape[-1]))
        res = (wts[..., None] * got.view(L, q, k, -1)).sum(2) / wts.sum(-1, keepdim=True)   # (L, q, C)
        if vals.shape[-1] > k:
            # a key tied with the k-th (or fewer than k keys inside, -inf): DINO keeps every key >= the k-th
            res = _with_ties(res, vals, sim, lab, k, temperature)
        out.append(res)
    return torch.cat(out, 1).transpose(1, 2)                                      # (L, C, S)


def _with_ties(res: torch.Tensor, vals: torch.Tensor, sim: torch.Tensor, lab: torch.Tensor, k: int,
               temperature: float) -> torch.Tensor:
    """``res`` (L, q, C) with the queries whose k-th and (k+1)-th similarities tie averaged over every key >= the
    k-th (``vals``: the top k + 1 of ``sim`` (L, q, K); ``lab`` (L, K, C)). Where reading which queries tie is
    free (the CPU) only those rows are computed; on a GPU every row is, and the tied ones selected (a read
    would stall its queue): the same rows either way."""
    tie = vals[..., k] == vals[..., k - 1]                                          # (L, q)
    zero = torch.zeros((), dtype=sim.dtype, device=sim.device)
    if reads_are_free(sim.device):
        li, qi = torch.nonzero(tie, as_tuple=True)
        if len(li):
            s = sim[li, qi]                                                         # (t, K)
            aff = torch.where(s >= vals[li, qi, k - 1:k], torch.exp((s - vals[li, qi, :1]) / temperature), zero)
            res[li, qi] = torch.bmm((aff / aff.sum(-1, keepdim=True))[:, None], lab[li])[:, 0]
        return res
    aff = torch.where(sim >= vals[..., k - 1:k], torch.exp((sim - vals[..., :1]) / temperature), zero)
    return torch.where(tie[..., None], torch.bmm(aff / aff.sum(-1, keepdim=True), lab), res)


def neighbourhood_mean(context_labels: torch.Tensor, near: torch.Tensor) -> torch.Tensor:
    """(L, n, C, S) context token labels, (S, S) bool `neighbourhood` -> (L, C, S): per target token the mean
    label over its neighbourhood in every context frame: `propagate` with constant features (every key
    equally similar, so every key in the neighbourhood is tied and kept), the propagation's chance level."""
    nearf = near.to(context_labels.device).to(context_labels.dtype)
    return (context_labels.sum(1) @ nearf.T) / (context_labels.shape[1] * nearf.sum(1))


def nearest_resize(labels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(..., h, w) label maps -> (..., H, W), nearest neighbour at pixel centres (output pixel i reads source
    floor((i + 0.5) h / H), PIL's NEAREST rule, as DINO resizes its predictions to the annotation's size)."""
    h, w = labels.shape[-2:]
    H, W = size
    if (h, w) == (H, W):
        return labels
    rows = torch.clamp(((torch.arange(H, device=labels.device) + 0.5) * h / H).long(), max=h - 1)
    cols = torch.clamp(((torch.arange(W, device=labels.device) + 0.5) * w / W).long(), max=w - 1)
    return labels[..., rows, :][..., cols]


def tokens_to_labels(probs: torch.Tensor, grid: tuple[int, int], size: tuple[int, int],
                     input_size: tuple[int, int] | None = None) -> torch.Tensor:
    """(L, C, S) token label scores -> (L, H, W) label indices (0 background, c = the c-th object): bilinear
    upsampling to the model input's ``input_size`` (default ``size``), each channel min-max normalised when its
    maximum is positive (DINO's ``norm_mask``), argmax, then nearest-neighbour resizing to the annotation's
    ``size`` (`nearest_resize`) when it differs: DINO's ``eval_video_segmentation.py`` upsamples by the
    patch size, takes the argmax and resizes the label map to the frame's original size."""
    L, C, _ = probs.shape
    at = tuple(size) if input_size is None else tuple(input_size)
    up = F.interpolate(probs.reshape(L, C, *grid), size=at, mode="bilinear", align_corners=False)
    lo = up.amin(dim=(-2, -1), keepdim=True)
    hi = up.amax(dim=(-2, -1), keepdim=True)
    scale = torch.where(hi > 0, (hi - lo).clamp(min=1e-30), torch.ones_like(hi))
    shift = torch.where(hi > 0, lo, torch.zeros_like(lo))
    # argmax over channels, the first of tied maxima (torch.argmax's rule), one channel at a time
    best = (up[:, 0] - shift[:, 0]) / scale[:, 0]
    labels = torch.zeros(best.shape, dtype=torch.uint8 if C < 256 else torch.long, device=best.device)
    for c in range(1, C):
        norm = (up[:, c] - shift[:, c]) / scale[:, c]
        better = norm > best
        labels.masked_fill_(better, c)
        best = torch.maximum(best, norm)
    return nearest_resize(labels, tuple(size)).long()


# ------------------------------------------------------------------------------------------------ PCK


def pck(pred_xy: np.ndarray, gt_xy: np.ndarray, ref_size: np.ndarray | float,
        alphas: Sequence[float] = PCK_ALPHAS) -> dict[float, np.ndarray]:
    """Per keypoint, correct (bool) at each alpha: ||pred - gt|| <= alpha * ref_size (ref_size = max(bbox h,
    w) of the target object, per keypoint or one number)."""
    d = np.linalg.norm(np.asarray(pred_xy, np.float64) - np.asarray(gt_xy, np.float64), axis=-1)
    ref = np.asarray(ref_size, np.float64)
    return {a: d <= a * ref for a in alphas}


def pck_chance(gt_xy: np.ndarray, ref_size: np.ndarray | float, centres: np.ndarray,
               alphas: Sequence[float] = PCK_ALPHAS) -> dict[float, np.ndarray]:
    """Per keypoint, the probability that a uniformly random target token (``centres``: (S, 2) x, y)
    lands within the threshold: PCK of a matcher that ignores the features."""
    d = np.linalg.norm(np.asarray(gt_xy, np.float64)[:, None] - np.asarray(centres, np.float64)[None], axis=-1)
    ref = np.broadcast_to(np.asarray(ref_size, np.float64), (len(d),))[:, None]
    return {a: (d <= a * ref).mean(1) for a in alphas}


def pck_counts(source: torch.Tensor, target: torch.Tensor, keypoints: torch.Tensor, centres: torch.Tensor,
               ref_size: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, counted: torch.Tensor,
               alphas: Sequence[float] = PCK_ALPHAS, pred: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """PCK of B pairs at once, as tensor ops on their device (no value read back).

    source: (B, L, K, D) L2-normalised features of the source tokens holding keypoints 0..K-1 (L feature sets,
    e.g. layers); target: (B, L, S, D) the target's tokens; keypoints: (B, K, 2) the target's true x, y and
    centres: (S, 2) the token centres, both in model-input pixels; ref_size: (B,) max(bbox h, w); scale,
    shift: (B, 2) the map to the pixels PCK is measured in, (xy - shift) / scale (1 and 0: model-input
    pixels); counted: (B, K) bool, the keypoints that count. Returns ``correct`` (B, L, A) int64: counted
    keypoints whose nearest target token (cosine, the first of ties) has its centre within alpha * ref_size of
    the true point (`pck`), and ``chance`` (B, A) float64: the sum over counted keypoints of `pck_chance`.
    ``pred`` (B, L, K, 2): predicted x, y in model-input pixels given by the caller (pixel-level matching,
    `pixel_matches`) instead of the nearest token's centre."""
    B, L, K, _ = source.shape
    S = target.shape[2]
    c = (centres.double()[None] - shift[:, None]) / scale[:, None]                       # (B, S, 2)
    gt = (keypoints.double() - shift[:, None]) / scale[:, None]                          # (B, K, 2)
    if pred is None:
        best = torch.einsum("blkd,blsd->blks", source, target).argmax(-1)               # (B, L, K)
        pred = torch.gather(c[:, None].expand(B, L, S, 2), 2, best[..., None].expand(B, L, K, 2))
    else:
        pred = (pred.double() - shift[:, None, None]) / scale[:, None, None]
    a = torch.tensor(alphas, dtype=torch.float64).to(ref_size.device, non_blocking=True)  # no stream sync
    thr = a[None] * ref_size.double()[:, None]
    d = torch.linalg.vector_norm(pred - gt[:, None], dim=-1)                              # (B, L, K)
    correct = ((d[..., None] <= thr[:, None, None]) & counted[:, None, :, None]).sum(2)
    near = torch.linalg.vector_norm(gt[:, :, None] - c[:, None], dim=-1)                 # (B, K, S)
    chance = ((near[..., None] <= thr[:, None, None]).double().mean(2) * counted[..., None]).sum(1)
    return correct, chance


def upsampled_tokens(x: torch.Tensor, grid: tuple[int, int], size: tuple[int, int]) -> torch.Tensor:
    """(L, S, D) patch tokens on ``grid`` -> (L, H*W, D) L2-normalised pixel features at ``size`` (H, W): the token
    map upsampled bilinearly (``F.interpolate``, ``align_corners=False``), pixels in row-major order. The pixel
    matching of Walmer et al.'s keypoint correspondence (``vit_analysis``) reads features at pixel resolution."""
    L, _, Dm = x.shape
    maps = x.transpose(1, 2).reshape(L, Dm, *grid)
    up = F.interpolate(maps.float(), size=tuple(size), mode="bilinear", align_corners=False)
    return F.normalize(up.flatten(2).transpose(1, 2), dim=-1)


def pixel_of(xy: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(..., 2) x, y in pixels (continuous: pixel i spans [i, i + 1)) -> (...) row-major index of the pixel
    holding the point, clamped to the image of ``size`` (H, W)."""
    H, W = size
    col = torch.clamp(torch.floor(xy[..., 0]), 0, W - 1).long()
    row = torch.clamp(torch.floor(xy[..., 1]), 0, H - 1).long()
    return row * W + col


def pixel_centres(size: tuple[int, int], device: torch.device | str = "cpu") -> torch.Tensor:
    """(H*W, 2) x, y centre of every pixel of an image of ``size`` (H, W), row-major."""
    H, W = size
    ys, xs = torch.meshgrid(torch.arange(H, device=device) + 0.5, torch.arange(W, device=device) + 0.5,
                            indexing="ij")
    return torch.stack([xs.flatten(), ys.flatten()], 1).double()


def pixel_matches(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(L, K, D) source pixel features, (L, P, D) target pixel features (both L2-normalised) -> (L, K) the target
    pixel of highest cosine per source keypoint (the first of ties)."""
    return torch.einsum("lkd,lpd->lkp", source, target).argmax(-1)


def gaussian_features(image_id: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random features of one image: N(0, 1) per token and channel, float32 on the CPU, from a generator seeded
    with ``RANDOM_FEATURE_SEED + seed + image_id`` (the image's dataset index), so an image gets the same
    features in every model, shard and resume. Walmer et al.'s (2023) "random" baseline of the dense tasks."""
    g = torch.Generator().manual_seed(RANDOM_FEATURE_SEED + int(seed) + int(image_id))
    return torch.randn(tuple(shape), generator=g)


# ------------------------------------------------------------------------------------------------ retrieval


def average_precision(positions: np.ndarray, n_positives: int) -> float:
    """AP from the 0-based ranks of the positives once junk is removed (sorted), trapezoid rule over recall
    steps of 1 / n_positives (revisitop ``compute_ap``)."""
    ap = 0.0
    step = 1.0 / n_positives
    for j, r in enumerate(np.asarray(positions)):
        p0 = 1.0 if r == 0 else j / r
        p1 = (j + 1) / (r + 1)
        ap += (p0 + p1) * step / 2.0
    return ap


def ranked_ap(order: np.ndarray, ok: Sequence[int], junk: Sequence[int] = ()) -> float:
    """AP of one ranking (database indices, best first) with positives ``ok``; ``junk`` is taken out of the
    ranking first. NaN when there are no positives."""
    ok = np.asarray(list(ok), dtype=np.int64)
    if len(ok) == 0:
        return float("nan")
    order = np.asarray(order)
    keep = ~np.isin(order, np.asarray(list(junk), dtype=np.int64))
    pos = np.flatnonzero(np.isin(order[keep], ok))
    return average_precision(pos, len(ok))


def revisited_protocols(gnd: Sequence[dict]) -> dict[str, list[dict[str, list[int]]]]:
    """Easy / Medium / Hard positives and ignored images from easy / hard / junk ground truth (revisitop
    ``example_evaluate.py``)."""
    def g(q: dict, k: str) -> list[int]:
        return [int(x) for x in q.get(k, [])]
    return {
        "easy": [{"ok": g(q, "easy"), "junk": g(q, "junk") + g(q, "hard")} for q in gnd],
        "medium": [{"ok": g(q, "easy") + g(q, "hard"), "junk": g(q, "junk")} for q in gnd],
        "hard": [{"ok": g(q, "hard"), "junk": g(q, "junk") + g(q, "easy")} for q in gnd],
    }


def retrieval_aps(scores: torch.Tensor, protocol: Sequence[dict]) -> np.ndarray:
    """(Q, N) similarity of each query to each database image -> (Q,) AP per query (NaN: no positives);
    ties broken by database index (stable sort)."""
    order = torch.sort(-scores.double(), dim=1, stable=True).indices.numpy()
    return np.array([ranked_ap(order[q], p["ok"], p["junk"]) for q, p in enumerate(protocol)])


def random_ranking_map(protocol: Sequence[dict], n_database: int, repeats: int = 32, seed: int = 0) -> float:
    """mAP of uniformly random rankings (the mean over ``repeats`` seeded draws): the chance level."""
    g = np.random.default_rng(seed)
    vals = []
    for _ in range(repeats):
        aps = [ranked_ap(g.permutation(n_database), p["ok"], p["junk"]) for p in protocol]
        aps = [a for a in aps if not math.isnan(a)]
        if aps:
            vals.append(float(np.mean(aps)))
    return float(np.mean(vals)) if vals else float("nan")


__all__ = ["BOUND_TH", "NEIGHBOURHOOD", "N_LAST_FRAMES", "PCK_ALPHAS", "TEMPERATURE", "TOPK", "VOID",
           "RANDOM_FEATURE_SEED", "average_precision", "bound_pixels", "boundary_f", "boundary_f_batch",
           "boundary_map", "disk", "gaussian_features", "jaccard", "jaccard_batch", "jf_objects", "label_presence",
           "labels_to_tokens", "nearest_resize", "neighbourhood", "pck", "pck_chance", "pck_counts", "pixel_centres",
           "pixel_matches", "pixel_of", "present_objects", "propagate", "random_ranking_map", "ranked_ap",
           "retrieval_aps", "revisited_protocols", "tokens_to_labels", "upsampled_tokens"]
