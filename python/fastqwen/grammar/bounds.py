"""Bounds on what a structured-output spec may ask of llguidance, checked before the library sees the spec.

llguidance compiles a grammar recursively: a chain of rules (or of JSON-schema `$ref`s) one deep per link takes one
set of stack frames per link, and a long enough chain overflows the stack and kills the process (a segfault, no
Python exception). Measured with llguidance 1.9.1 on a thread with an 8 MiB stack (tests/test_grammar_isolation.py
keeps the figures honest): a Lark chain `rN: rN+1 | "tN"` crashes from 2,650 rules; a `$defs` chain crashes from 600
links when each link holds two `$ref`s, from 910 with one `$ref` under a required property, from 1,030 under `anyOf`,
from 2,500 as bare `$ref`s; a schema nested 10,000 objects deep crashes its conversion from Python. The limits below sit well under those at the
stack the frontend validates on (validator.VALIDATOR_STACK_BYTES, 16 MiB: about twice those figures), and the
engine compiles on four times that stack (compiler.COMPILE_STACK_BYTES). What the bounds do not foresee costs one
request: the frontend validates in a separate process (validator.py).
"""

from __future__ import annotations

import re

# A spec's text in UTF-8 bytes. Real schemas and grammars are kilobytes to tens of kilobytes; a compiled grammar holds
# about 30 times its text (compiler.estimated_bytes), so this also bounds one compile's memory.
MAX_SPEC_BYTES = 1 << 20
# Rules of a Lark grammar (after a GBNF one is converted). Full programming-language grammars have a few hundred;
# a chain of 2,650 overflows an 8 MiB stack.
MAX_GRAMMAR_RULES = 1000
# Nesting of objects and arrays in a JSON schema document (each schema level is one to three of them). Real schemas
# nest a few dozen deep. llguidance reads its grammar JSON with a nesting limit of 128, less the levels of its own
# wrapper (it refuses a schema about 125 deep as "recursion limit exceeded"); this says so first, and clearly. (Given
# as a Python dict, a schema thousands deep crashes its conversion: one more reason to stop it here.)
MAX_SCHEMA_DEPTH = 100
# `$ref` keywords in a schema (JSON schema or %json inside a grammar). A chain of references needs one per link, so
# this bounds the chain without resolving it; API-sized schemas have tens to a few hundred.
MAX_SCHEMA_REFS = 500

# A Lark rule or terminal definition: `name:`, `?name:`, `!name:`, `name.2:` at the start of a line (not GBNF's `::=`).
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?\d+)?[ \t]*:(?!:)", re.MULTILINE)


def spec_bytes_problem(spec: str) -> str | None:
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        return f"it is {size} bytes long; at most {MAX_SPEC_BYTES} are compiled"
    return None


def lark_problem(lark: str) -> str | None:
    """Why this Lark grammar text is beyond the bounds (None: within them)."""
    rules = len(_LARK_RULE.findall(lark))
    if rules > MAX_GRAMMAR_RULES:
        return f"it has {rules} rules; at most {MAX_GRAMMAR_RULES} are compiled"
    refs = lark.count('"$ref"')
    if refs > MAX_SCHEMA_REFS:
        return f"its JSON schemas have {refs} $ref keywords; at most {MAX_SCHEMA_REFS} are compiled"
    return None


def schema_problem(schema) -> str | None:
    """Why this parsed JSON schema is beyond the bounds (None: within them). Walks the document without recursion."""
    refs = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"it nests more than {MAX_SCHEMA_DEPTH} objects and arrays deep"
        if isinstance(node, dict):
            if "$ref" in node:
                refs += 1
                if refs > MAX_SCHEMA_REFS:
                    return f"it has more than {MAX_SCHEMA_REFS} $ref keywords; at most {MAX_SCHEMA_REFS} are compiled"
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)
    return None
