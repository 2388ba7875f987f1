"""What the model definition says of each on-disk tensor: its :class:`Role`, and the :class:`Definition`.

The data the definition's builder (:mod:`fp4convert.plan.model_build`, in a child process) hands the planner,
through JSON (:mod:`fp4convert.plan.definition`: the child's answer and the on-disk cache). Plain dataclasses;
imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp4convert.errors import DefinitionUnknown

LINEAR, EXPERTS, KEPT = "linear", "experts", "kept"


@dataclass(frozen=True)
class Role:
    """What one on-disk tensor is, per the model definition.

    ``kind`` is LINEAR (a matmul weight; ``input_axis`` is its input axis ON DISK), EXPERTS (a 3-D
    stack: ``transpose`` when the disk holds ``[E, in, out]``, ``split`` of a gate/up stack, ``proj``)
    or KEPT (``why`` says why, naming the module class). ``module`` is the module as transformers
    builds it (after its key conversion), the name compressed-tensors' ``ignore`` is matched against.
    """

    kind: str
    module: str
    module_class: str
    why: str = ""
    input_axis: int | None = None
    transpose: bool = False
    split: str | None = None
    proj: str | None = None
    group: str | None = None  # shared-scale group from a transformers merge (one expert's gate + up)
    absent: bool = False  # no parameter of the model loads it (transformers drops it: MTP layers, extras)
    also: tuple[str, ...] = ()  # further modules transformers loads the tensor into (one disk tensor split in parts)
    names: tuple[str, ...] | None = None  # EXPERTS: per-expert output leaves (gate, up, down) from the definition
    tf_fp4: str = ""  # quantized: transformers cannot load any FP4 form of it (the output is for vLLM); kept: why
    # transformers cannot load it as FP4 under its checkpoint name (so it is kept for both consumers)
    dequant_route: bool = False  # transformers' compressed-tensors load routes this bf16 key through a converter
    # that dequantizes first, which drops an unquantized tensor: the tensor must be written FP4 for it to load


@dataclass
class Definition:
    """The model as transformers defines it, reduced to what the planner asks."""

    model_class: str
    transformers_version: str
    roles: dict[str, Role]
    heads: tuple[str, ...]  # output projections (lm_head, proj_out, embed_out) as transformers builds them
    head_on_disk: bool = False
    notes: list[str] = field(default_factory=list)
    # why transformers cannot load a compressed-tensors checkpoint of this model at all ("" when it can)
    transformers_cannot_load: str = ""
    # the language model's root module ("" the model itself); None: no language model beside other parts,
    # the model is quantized whole (docs/formats.md "Which tensors are quantized")
    language_model: str | None = None
    # parts transformers could not build here, and the packages that would let it ("" when none)
    unbuilt: str = ""

    @property
    def source(self) -> str:
        return f"transformers {self.transformers_version} {self.model_class}"

    def role(self, name: str) -> Role | None:
        return self.roles.get(name)


Unknown = DefinitionUnknown  # the model definition cannot be had; the message says why


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, cut at 200 characters (an :class:`Unknown` says it in one line)."""
    return " ".join(str(exc).split())[:200]
