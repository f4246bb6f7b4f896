"""The rlhfc IR: stage graph, types, canonical text form, verifier.

This package imports nothing else of rlhfc; every other stage of the compiler imports it.
"""

from .arch import ARCHS, HEADS, PRESETS, human_count, param_count
from .core import (DATA_OPTIONS, Cluster, DataSource, Graph, Model, Module, RunConfig, Stage, Symbol, Tool, Value,
                   VersionEdge, derive_versions)
from .devices import DEVICE_MEMORY, GPU_KINDS
from .diagnostics import CompileError, Diagnostic, DiagnosticSink, Loc, error
from .ops import Attr, Emit, Operand, OpSpec, all_ops, get_op, register_op
from .parser import parse_ir
from .printer import print_module
from .types import ValueType
from .verifier import VerificationError, register_check, verify, where

__all__ = [
    "ARCHS", "HEADS", "PRESETS", "human_count", "param_count",
    "Cluster", "DataSource", "Graph", "Model", "Module", "RunConfig", "Stage", "Symbol", "Tool", "Value", "VersionEdge",
    "derive_versions", "DATA_OPTIONS", "DEVICE_MEMORY", "GPU_KINDS",
    "CompileError", "Diagnostic", "DiagnosticSink", "Loc", "error",
    "Attr", "Emit", "Operand", "OpSpec", "all_ops", "get_op", "register_op",
    "parse_ir", "print_module", "ValueType", "VerificationError", "register_check", "verify", "where",
]
