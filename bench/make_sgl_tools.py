"""SGLang's serving benchmark (`python -m sglang.benchmark.serving`, the client of bench/results' HTTP figures) as a
folder that runs without SGLang's runtime: its `sglang/benchmark/` package taken from an SGLang wheel, an empty
`sglang/__init__.py` (the real one imports the whole server), and small stand-ins for the few modules that path
imports and a GPU machine without network may lack (two `sglang.srt` helpers, orjson, msgspec, pybase64). The
measurement code is SGLang's, unchanged, but for two edits: mmmu.py imports HF `datasets` when that dataset is used
(as longbench_v2.py already does), and the completions payload no longer carries `"best_of": 1` (the default; SMG
1.13 answers 400 to `best_of` with `stream`).

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl
    python bench/make_sgl_tools.py /tmp/sgl/sglang-0.5.23-*.whl .sgl
    cd .sgl && python -m sglang.benchmark.serving --backend vllm --host 127.0.0.1 --port 8000 \\
        --dataset-name random-ids --random-range-ratio 1 --random-input-len 128 --random-output-len 1024 \\
        --num-prompts 512 --max-concurrency 256 --tokenizer MODEL_DIR --model MODEL_DIR

bench/gpu_check.sh (SGL_TOOLS=folder) and bench/gpu_check_tp.sh (.sgl/) use such a folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import zipfile

STANDINS = {
    "sglang/__init__.py": '"""SGLang\'s benchmark package alone (bench/make_sgl_tools.py): no runtime."""\n',
    "sglang/srt/__init__.py": "",
    "sglang/srt/utils/__init__.py": "",
    "sglang/srt/disaggregation/__init__.py": "",
    "sglang/srt/disaggregation/utils.py": (
        '"""The one constant serving.py imports from sglang.srt.disaggregation.utils (same value)."""\n\n'
        'FAKE_BOOTSTRAP_HOST = "2.2.2.2"\n'
    ),
    "sglang/srt/utils/network.py": '''"""The two URL helpers serving.py imports from sglang.srt.utils.network (IPv6 hosts bracketed)."""


def _bracketed(host: str) -> str:
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return f"[{host}]" if ":" in host else host


def resolve_base_url(base_url: str, host: str, port: int) -> str:
    return base_url or f"http://{_bracketed(host)}:{port}"


def resolve_host_port(base_url: str, host: str, port: int) -> str:
    return base_url or f"{_bracketed(host)}:{port}"
''',
    "orjson.py": '''"""json in orjson's shape (loads; dumps returning bytes), for a machine without orjson."""
import json as _json

JSONDecodeError = _json.JSONDecodeError
OPT_INDENT_2 = 1


def loads(data):
    return _json.loads(data)


def dumps(obj, default=None, option=None):
    indent = 2 if option and option & OPT_INDENT_2 else None
    separators = None if indent else (",", ":")
    return _json.dumps(obj, default=default, indent=indent, separators=separators, ensure_ascii=False).encode()
''',
    "msgspec/__init__.py": '''"""msgspec.Struct as a dataclass (keyword construction, frozen=), for a machine without msgspec."""
import dataclasses as _dataclasses


class Struct:
    def __init_subclass__(cls, frozen=False, **kwargs):
        super().__init_subclass__()
        _dataclasses.dataclass(frozen=frozen, kw_only=kwargs.get("kw_only", False))(cls)


from . import structs  # noqa: E402,F401
''',
    "msgspec/structs.py": '''"""msgspec.structs over the dataclass-backed Struct (asdict is shallow, as msgspec's)."""
import dataclasses as _dataclasses


def asdict(obj):
    return {f.name: getattr(obj, f.name) for f in _dataclasses.fields(obj)}


def fields(obj):
    return _dataclasses.fields(obj)


def replace(obj, **changes):
    return _dataclasses.replace(obj, **changes)
''',
    "pybase64.py": '"""base64 under pybase64\'s names (the image datasets only)."""\n'
    "from base64 import b64decode, b64encode, standard_b64decode, standard_b64encode  # noqa: F401\n",
}

# (file, exact text, replacement): each text must occur exactly once
EDITS = [
    (
        "sglang/benchmark/datasets/mmmu.py",
        "from datasets import load_dataset\n",
        "",
    ),
    (
        "sglang/benchmark/serving.py",
        '            "prompt": prompt,\n            "best_of": 1,\n',
        '            "prompt": prompt,\n',
    ),
]
MMMU_LAZY_IMPORT = "    from datasets import load_dataset  # here, not at import: only this dataset needs HF datasets\n"
KEEP = ("serving.py", "goodput.py", "utils.py", "__init__.py")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("wheel", help="an SGLang wheel (written against 0.5.23)")
    p.add_argument("out", help="the folder to write (run the benchmark from it)")
    args = p.parse_args(argv)
    with zipfile.ZipFile(args.wheel) as wheel:
        for name in wheel.namelist():
            inside = name.startswith("sglang/benchmark/")
            base = name.rsplit("/", 1)[-1]
            if inside and name.endswith(".py") and ("/datasets/" in name or base in KEEP):
                target = os.path.join(args.out, name)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(wheel.read(name))
    for name, text in STANDINS.items():
        target = os.path.join(args.out, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(text)
    for name, old, new in EDITS:
        path = os.path.join(args.out, name)
        with open(path) as f:
            text = f.read()
        if text.count(old) != 1:
            sys.exit(f"{name}: expected one {old!r}; is the wheel SGLang 0.5.23?")
        text = text.replace(old, new)
        if name.endswith("mmmu.py"):  # the import moves into the loader that needs it
            head, sep, body = text.partition("\ndef ")
            loader = body.index(":\n") + 2
            text = head + sep + body[:loader] + MMMU_LAZY_IMPORT + body[loader:]
        with open(path, "w") as f:
            f.write(text)
    print(f"wrote {args.out}: python -m sglang.benchmark.serving runs from there")
    return 0


if __name__ == "__main__":
    sys.exit(main())
