"""The sources vitscope reproduces, in one place: short key -> full reference.

Report sections, figure captions, docstrings and ``vitscope zoo findings`` cite these keys through
:func:`cite` ("Walmer et al. 2023"), never by an internal file number. ``REFERENCES`` is a plain public dict so
other tools (e.g. the analysis listing) can print it as it is.

    >>> from vitscope.references import REFERENCES, cite
    >>> cite("walmer2023", "Fig. 5")
    'Walmer et al. 2023, Fig. 5'
"""

from __future__ import annotations

REFERENCES: dict[str, str] = {
    "shekhar2022": ("Shekhar, Bordes, Vincent, Morcos. Understanding contrastive versus reconstructive "
                    "self-supervised learning of Vision Transformers. NeurIPS 2022 Workshop on "
                    "Self-Supervised Learning."),
    "park2023": ("Park, Kim, Heo, Kim, Yun. What do self-supervised Vision Transformers learn? ICLR 2023."),
    "merlin2023": ("Merlin, Nanda, Rawal, Toneva. What happens during finetuning of Vision Transformers: "
                   "an invariance based investigation. 2023."),
    "walmer2023": ("Walmer, Suri, Gupta, Shrivastava. Teaching Matters: Investigating the role of supervision "
                   "in Vision Transformers. CVPR 2023."),
    "wang2023": ("Wang. Contrastive learning meets masked modeling. Paper reading session slides, Australian "
                 "National University, 2023."),
}
"""Full reference of every source, by key (first author's surname + year)."""

SHORT: dict[str, str] = {
    "shekhar2022": "Shekhar et al. 2022",
    "park2023": "Park et al. 2023",
    "merlin2023": "Merlin et al. 2023",
    "walmer2023": "Walmer et al. 2023",
    "wang2023": "Wang 2023",
}
"""How the text cites each source inline."""


def cite(key: str, where: str = "") -> str:
    """Inline citation of ``key`` (a key of :data:`REFERENCES`), optionally with a place: ``"Walmer et al.
    2023, Fig. 5"``. An unknown key is an error, so a typo cannot reach a reader."""
    if key not in REFERENCES:
        raise KeyError(f"unknown reference {key!r}; known: {', '.join(REFERENCES)}")
    return SHORT[key] + (f", {where}" if where else "")
