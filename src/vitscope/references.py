"""The papers the analyses come from, as full references (`vitscope analyses` and docs/analyses.md print them).

``REFERENCES`` maps a short key to its citation; ``SEEDS`` maps the project's source documents (seed 000 ...
004, the files the toolkit was specified from) to their key; ``ANALYSIS_REFERENCES`` maps each registered
analysis to the keys of its sources, the protocol's paper first. Plain dicts, so adding an analysis or a
paper is one line each.
"""

from __future__ import annotations

REFERENCES: dict[str, str] = {
    "shekhar2022": "Shashank Shekhar, Florian Bordes, Pascal Vincent, Ari Morcos. Understanding contrastive versus "
                   "reconstructive self-supervised learning of Vision Transformers. NeurIPS 2022 Workshop on "
                   "Self-Supervised Learning: Theory and Practice, 2022.",
    "park2023": "Namuk Park, Wonjae Kim, Byeongho Heo, Taekyung Kim, Sangdoo Yun. What do self-supervised Vision "
                "Transformers learn? International Conference on Learning Representations (ICLR), 2023. "
                "arXiv:2305.00729.",
    "merlin2023": "Gabriele Merlin, Vedant Nanda, Ruchit Rawal, Mariya Toneva. What happens during finetuning of "
                  "Vision Transformers: an invariance based investigation. Conference on Lifelong Learning "
                  "Agents (CoLLAs), 2023. arXiv:2307.06006.",
    "walmer2023": "Matthew Walmer, Saksham Suri, Kamal Gupta, Abhinav Shrivastava. Teaching Matters: investigating "
                  "the role of supervision in Vision Transformers. IEEE/CVF Conference on Computer Vision and "
                  "Pattern Recognition (CVPR), 2023. arXiv:2212.03862.",
    "wang_clmm": "Lei Wang. Contrastive learning meets masked modeling. Paper reading session slides, Australian "
                 "National University and Data61/CSIRO.",
    "park_kim2022": "Namuk Park, Songkuk Kim. How do Vision Transformers work? International Conference on "
                    "Learning Representations (ICLR), 2022. arXiv:2202.06709.",
    "nguyen2021": "Thao Nguyen, Maithra Raghu, Simon Kornblith. Do wide and deep networks learn the same things? "
                  "Uncovering how neural network representations vary with width and depth. International "
                  "Conference on Learning Representations (ICLR), 2021. arXiv:2010.15327.",
    "kornblith2019": "Simon Kornblith, Mohammad Norouzi, Honglak Lee, Geoffrey Hinton. Similarity of neural network "
                     "representations revisited. International Conference on Machine Learning (ICML), PMLR 97, "
                     "pp. 3519-3529, 2019.",
    "caron2021": "Mathilde Caron, Hugo Touvron, Ishan Misra, Hervé Jégou, Julien Mairal, Piotr Bojanowski, Armand "
                 "Joulin. Emerging properties in self-supervised Vision Transformers. IEEE/CVF International "
                 "Conference on Computer Vision (ICCV), 2021. arXiv:2104.14294.",
    "nanda2022": "Vedant Nanda, Till Speicher, Camila Kolling, John P. Dickerson, Krishna P. Gummadi, Adrian Weller. "
                 "Measuring representational robustness of neural networks through shared invariances. "
                 "International Conference on Machine Learning (ICML), PMLR 162, 2022.",
    "geirhos2019": "Robert Geirhos, Patricia Rubisch, Claudio Michaelis, Matthias Bethge, Felix A. Wichmann, "
                   "Wieland Brendel. ImageNet-trained CNNs are biased towards texture; increasing shape bias improves "
                   "accuracy and robustness. International Conference on Learning Representations (ICLR), 2019.",
    "hendrycks2019": "Dan Hendrycks, Thomas Dietterich. Benchmarking neural network robustness to common corruptions "
                     "and perturbations. International Conference on Learning Representations (ICLR), 2019.",
    "pont-tuset2017": "Jordi Pont-Tuset, Federico Perazzi, Sergi Caelles, Pablo Arbeláez, Alexander Sorkine-Hornung, "
                      "Luc Van Gool. The 2017 DAVIS challenge on video object segmentation. arXiv:1704.00675, 2017.",
    "perazzi2016": "Federico Perazzi, Jordi Pont-Tuset, Brian McWilliams, Luc Van Gool, Markus Gross, Alexander "
                   "Sorkine-Hornung. A benchmark dataset and evaluation methodology for video object segmentation. "
                   "IEEE/CVF Conference on Computer Vision and Pattern Recognition (CVPR), 2016.",
    "min2019": "Juhong Min, Jongmin Lee, Jean Ponce, Minsu Cho. SPair-71k: a large-scale benchmark for semantic "
               "correspondence. arXiv:1908.10543, 2019.",
    "radenovic2018": "Filip Radenović, Ahmet Iscen, Giorgos Tolias, Yannis Avrithis, Ondřej Chum. Revisiting Oxford "
                     "and Paris: large-scale image retrieval benchmarking. IEEE/CVF Conference on Computer Vision and "
                     "Pattern Recognition (CVPR), 2018.",
    "abnar2020": "Samira Abnar, Willem Zuidema. Quantifying attention flow in transformers. Annual Meeting of the "
                 "Association for Computational Linguistics (ACL), 2020. arXiv:2005.00928.",
    "chefer2021": "Hila Chefer, Shir Gur, Lior Wolf. Generic attention-model explainability for interpreting "
                  "bi-modal and encoder-decoder transformers. IEEE/CVF International Conference on Computer Vision "
                  "(ICCV), 2021. arXiv:2103.15679.",
    "michel2019": "Paul Michel, Omer Levy, Graham Neubig. Are sixteen heads really better than one? Advances in "
                  "Neural Information Processing Systems (NeurIPS), 2019. arXiv:1905.10650.",
    "nostalgebraist2020": "nostalgebraist. Interpreting GPT: the logit lens. LessWrong, 2020.",
    "darcet2024": "Timothée Darcet, Maxime Oquab, Julien Mairal, Piotr Bojanowski. Vision Transformers need "
                  "registers. International Conference on Learning Representations (ICLR), 2024. arXiv:2309.16588.",
    "vandermaaten2008": "Laurens van der Maaten, Geoffrey Hinton. Visualizing data using t-SNE. Journal of Machine "
                        "Learning Research 9, pp. 2579-2605, 2008.",
    "williams2021": "Alex H. Williams, Erin Kunz, Simon Kornblith, Scott W. Linderman. Generalized shape metrics on "
                    "neural representations. Advances in Neural Information Processing Systems (NeurIPS), 2021.",
    "raghu2017": "Maithra Raghu, Justin Gilmer, Jason Yosinski, Jascha Sohl-Dickstein. SVCCA: singular vector "
                 "canonical correlation analysis for deep learning dynamics and interpretability. Advances in "
                 "Neural Information Processing Systems (NeurIPS), 2017.",
    "morcos2018": "Ari S. Morcos, Maithra Raghu, Samy Bengio. Insights on representational similarity in neural "
                  "networks with canonical correlation. Advances in Neural Information Processing Systems "
                  "(NeurIPS), 2018.",
    "kriegeskorte2008": "Nikolaus Kriegeskorte, Marieke Mur, Peter Bandettini. Representational similarity "
                        "analysis: connecting the branches of systems neuroscience. Frontiers in Systems "
                        "Neuroscience 2:4, 2008.",
    "huh2024": "Minyoung Huh, Brian Cheung, Tongzhou Wang, Phillip Isola. The Platonic Representation Hypothesis. "
               "International Conference on Machine Learning (ICML), 2024. arXiv:2405.07987.",
    "ramasesh2021": "Vinay V. Ramasesh, Ethan Dyer, Maithra Raghu. Anatomy of catastrophic forgetting: hidden "
                    "representations and task semantics. International Conference on Learning Representations "
                    "(ICLR), 2021. arXiv:2007.07400.",
}

#: the project's source documents (docstrings say "seed 003 §4.2") -> their reference
SEEDS: dict[str, str] = {
    "000": "shekhar2022",
    "001": "park2023",
    "002": "merlin2023",
    "003": "walmer2023",
    "004": "wang_clmm",
}

#: analysis name -> its sources, the paper whose protocol it follows first
ANALYSIS_REFERENCES: dict[str, list[str]] = {
    "attention_distance": ["walmer2023", "park2023"],
    "attention_nmi": ["park2023"],
    "cls_attention_maps": ["walmer2023"],
    "aligned_attention_maps": ["walmer2023"],
    "query_attention_maps": ["park2023", "wang_clmm"],
    "attention_explorer": ["walmer2023", "abnar2020"],
    "saliency_iou": ["walmer2023"],
    "cka": ["shekhar2022", "nguyen2021", "kornblith2019", "walmer2023", "merlin2023"],
    "residual_cka": ["walmer2023"],
    "similarity": ["williams2021", "raghu2017", "morcos2018", "kriegeskorte2008", "huh2024", "ramasesh2021"],
    "diversity": ["park2023", "wang_clmm"],
    "svd_volume": ["park2023"],
    "fourier": ["park2023", "park_kim2022"],
    "tsne": ["park2023", "vandermaaten2008"],
    "semantics": ["shekhar2022", "walmer2023", "caron2021"],
    "shape_bias": ["park2023", "geirhos2019"],
    "band_noise": ["park2023", "park_kim2022"],
    "corruptions": ["merlin2023", "hendrycks2019"],
    "propagation": ["walmer2023", "caron2021", "perazzi2016", "pont-tuset2017"],
    "stir": ["merlin2023", "nanda2022"],
    "correspondence": ["walmer2023", "min2019"],
    "retrieval": ["walmer2023", "radenovic2018"],
    "attention_rollout": ["abnar2020", "walmer2023"],
    "gradient_rollout": ["chefer2021", "abnar2020"],
    "logit_lens": ["nostalgebraist2020"],
    "high_norm_tokens": ["darcet2024"],
    "head_ablation": ["michel2019"],
    "head_agreement": ["shekhar2022"],
    "block_updates": ["park2023", "wang_clmm"],
}


def references_of(analysis: str) -> list[str]:
    """The full references of an analysis's sources (empty when it has none listed)."""
    return [REFERENCES[k] for k in ANALYSIS_REFERENCES.get(analysis, [])]


def short_citation(key: str) -> str:
    """'Walmer et al. 2023' from a reference key."""
    ref = REFERENCES[key]
    # the authors end at the first ". " that does not follow a middle initial ("Alex H. Williams, ...")
    end = next((i for i in range(len(ref) - 1) if ref[i:i + 2] == ". " and len(ref[:i].split()[-1]) > 1),
               len(ref))
    authors, rest = ref[:end], ref[end + 2:]
    names = [a.strip() for a in authors.split(",")]
    year = next((w.rstrip(".,") for w in reversed(rest.split()) if w.rstrip(".,").isdigit()
                 and len(w.rstrip(".,")) == 4), "")
    last = names[0].split()[-1] if names[0].split()[-2:-1] != ["der"] else " ".join(names[0].split()[-3:])
    who = last if len(names) == 1 else f"{last} and {names[1].split()[-1]}" if len(names) == 2 else f"{last} et al."
    return f"{who} {year}".strip()


SHORT: dict[str, str] = {k: short_citation(k) for k in REFERENCES}
"""How the text cites each source inline ('Walmer et al. 2023'), by key."""


def cite(key: str, where: str = "") -> str:
    """Inline citation of ``key`` (a key of :data:`REFERENCES`), optionally with a place: ``"Walmer et al.
    2023, Fig. 5"``. Report captions and `vitscope zoo findings` cite this way, never by a source document's
    number; an unknown key is an error, so a typo cannot reach a reader."""
    if key not in REFERENCES:
        raise KeyError(f"unknown reference {key!r}; known: {', '.join(REFERENCES)}")
    return SHORT[key] + (f", {where}" if where else "")
