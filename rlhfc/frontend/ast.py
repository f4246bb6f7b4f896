"""The typed AST of a ``.rlhf`` program; every node carries its source location."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhfc.ir.diagnostics import Loc


@dataclass
class Literal:
    """A constant: ``kind`` is int, float, size, str, bool, ident (a bare word) or device (``cpu:2``)."""

    value: object
    kind: str
    loc: Loc


@dataclass
class Ref:
    """A name used as a positional argument (a model, data source or pipeline value)."""

    name: str
    loc: Loc


@dataclass
class KwArg:
    name: str
    value: Literal
    loc: Loc


@dataclass
class Call:
    """``receiver.name(args)`` or ``name(args)``; positional args are Refs, Calls or Literals."""

    name: str
    receiver: Ref | None
    args: list
    kwargs: list[KwArg]
    loc: Loc
    name_loc: Loc


@dataclass
class Setting:
    name: str
    value: Literal
    loc: Loc


@dataclass
class ClusterDecl:
    name: str
    settings: list[Setting]
    loc: Loc


@dataclass
class RunDecl:
    settings: list[Setting]
    loc: Loc


@dataclass
class ModelDecl:
    """``model NAME = ctor(...) [head = ...] [clause(...)] [trainable|frozen]``; ``clauses`` are the
    call-shaped options (``layout(dp = 2)``), receiver-less Calls."""

    name: str
    ctor: Call
    options: list[Setting]
    flag: str | None
    loc: Loc
    name_loc: Loc
    clauses: list[Call] = field(default_factory=list)


@dataclass
class DataDecl:
    name: str
    ctor: Call
    loc: Loc
    name_loc: Loc


@dataclass
class ToolDecl:
    """``tool NAME = python("module:function", timeout = 2, memory = 256M)``, or (``kind = "env"``)
    ``env NAME = python("module:Class")``."""

    name: str
    ctor: Call
    loc: Loc
    name_loc: Loc
    kind: str = "tool"


@dataclass
class Stmt:
    """``targets = call`` (or a bare ``call``); ``index`` is its position in the pipeline."""

    targets: list[Ref]
    call: Call
    loc: Loc
    index: int = 0


@dataclass
class PipelineDecl:
    name: str
    params: list[KwArg]
    stmts: list[Stmt]
    loc: Loc
    name_loc: Loc


@dataclass
class Program:
    file: str
    text: str
    clusters: list[ClusterDecl] = field(default_factory=list)
    models: list[ModelDecl] = field(default_factory=list)
    data: list[DataDecl] = field(default_factory=list)
    tools: list[ToolDecl] = field(default_factory=list)
    pipelines: list[PipelineDecl] = field(default_factory=list)
    runs: list[RunDecl] = field(default_factory=list)
