"""Do the tests fail where the bugs would be? Builds mutants of the package (one deliberate bug each) and runs the tests
that should catch each one against it; a mutant "survives" when they all pass.

    python tests/mutation_check.py --build-dir BUILD [--only gpu|cpu] [--out DIR]

Each mutant is a copy of the installed package (or of the one on PYTHONPATH) with one exact-string edit: a Python
file edited in the copy, or a CUDA file recompiled into the copy's _C module. For the CUDA ones, BUILD is the CMake
build directory of that package (`pip install --no-build-isolation --no-deps -Cbuild-dir=BUILD .`): only the mutated
file is recompiled, with the build's own nvcc and link commands (`ninja -t commands`). Nothing in the source tree is
changed. Exit status 0 when every mutant is caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Mutation:
    name: str
    path: str  # repository path of the file to edit
    edits: list[tuple[str, str]]  # (exact text, its replacement); each text must occur exactly once
    tests: list[str]  # pytest node ids that must fail
    why: str

    @property
    def cuda(self) -> bool:
        return self.path.endswith(".cu")


KERNEL_LIBRARY = "libfastqwen_kernels.a"  # CMakeLists.txt's fastqwen_kernels target
DECODE = "csrc/attention_decode.cu"
PREFILL = "csrc/attention_prefill.cu"
DECODE_TESTS = ["tests/test_attention_gpu.py::test_decode_every_chunk_counts"]
PREFILL_TESTS = ["tests/test_attention_gpu.py::test_prefill_every_tile_counts"]

MUTATIONS = [
    Mutation(
        "decode_skips_first_chunk",
        DECODE,
        [
            (
                "  it.n_tiles = (max(it.end - it.start, 0) + tile - 1) / tile;",
                "  it.n_tiles = it.split == 0 && it.num_splits > 1 ? 0 : (max(it.end - it.start, 0) + tile - 1) / tile;",
            )
        ],
        DECODE_TESTS,
        "the first chunk of a split sequence computes nothing (its keys are dropped)",
    ),
    Mutation(
        "decode_merge_skips_last_chunk",
        DECODE,
        [
            (
                "  for (int s = 0; s < n; ++s) o += weight[s] * part[s * stride];",
                "  for (int s = 0; s < n - 1; ++s) o += weight[s] * part[s * stride];",
            )
        ],
        DECODE_TESTS,
        "the merge leaves out the last chunk's output (its weight still counts in the sum)",
    ),
    Mutation(
        "decode_merge_equal_weights",
        DECODE,
        [
            (
                "    const float w = m != -INFINITY && d < n ? exp2f(lse - m) : 0.0f;  // log2 units",
                "    const float w = m != -INFINITY && d < n ? 1.0f : 0.0f;",
            )
        ],
        DECODE_TESTS,
        "chunks merged with equal weights instead of their softmax mass",
    ),
    Mutation(
        "decode_ignores_split_limit",
        DECODE,
        [
            (
                "  const int want = max(min_chunk, (len + kDecodeMaxSplits - 1) / kDecodeMaxSplits);",
                "  const int want = min_chunk;",
            ),
            (
                "    const int n = b < batch ? max(1, (len + clen - 1) / clen) : 0;",
                "    const int n = b < batch ? max(1, min(kDecodeMaxSplits, (len + clen - 1) / clen)) : 0;",
            ),
        ],
        DECODE_TESTS,
        "chunks stay at the minimum length and are capped at 32: keys past 32 chunks are dropped",
    ),
    Mutation(
        "prefill_skips_first_tile",
        PREFILL,
        [
            (
                "              if (masked && j * kBN + ni * 8 + (lane & 3) * 2 + e > row_pos[mi][h]) x = -INFINITY;",
                "              if (masked && j * kBN + ni * 8 + (lane & 3) * 2 + e > row_pos[mi][h]) x = -INFINITY;\n"
                "              if (j == 0 && n_kv_tiles > 1) x = -INFINITY;",
            )
        ],
        PREFILL_TESTS,
        "the first 64-key tile is masked out whenever there is more than one",
    ),
    Mutation(
        "prefill_no_rescale",
        PREFILL,
        [("          const float alpha = fast_exp2(m_run[mi][h] - m_use);", "          const float alpha = 1.0f;")],
        PREFILL_TESTS,
        "earlier tiles are not rescaled when the running max grows (tiles merged with wrong weights)",
    ),
    Mutation(
        "gemv_fp8_ring_reloads_its_chunk",
        "csrc/gemv.cu",
        [
            (
                "            wv[r] = load_stream(rows.rows0 + rows.row_off[r] + next);",
                "            wv[r] = load_stream(rows.rows0 + rows.row_off[r] + c);",
            )
        ],
        ["tests/test_gemv_gpu.py::test_gemv_matches_reference_on_qwen3_shapes[Qwen3-8B-fp8]"],
        "the one-token FP8 GEMV multiplies each lane's first chunk of a row again in place of the later ones",
    ),
    Mutation(
        "gemv_norm_sums_squares_of_weighted_x",
        "csrc/gemv.cu",
        [
            (
                "      sq = fmaf(out[i], out[i], sq);\n      out[i] *= gf[i];",
                "      out[i] *= gf[i];\n      sq = fmaf(out[i], out[i], sq);",
            )
        ],
        ["tests/test_gemv_gpu.py::test_norm_in_gemv_matches_float64_and_the_norm_kernel[8B-bf16]"],
        "the GEMV that finishes an RMSNorm takes the rms of x * weight instead of x's",
    ),
    Mutation(
        "fold_norm_keeps_the_norm_weight",
        "python/fastqwen/weights.py",
        [("    norm_weight.fill_(1)\n", "")],
        ["tests/test_gemv_gpu.py::test_engine_norms_in_gemv_match_the_norm_kernels[none]"],
        "the norm weight goes into the projection's columns but the norm kernels (prefill, batches) still apply it too",
    ),
    Mutation(
        "yarn_attention_factor_left_out",
        "python/fastqwen/ops/rope_kv.py",
        [
            (
                "torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor",
                "torch.cat([freqs.cos(), freqs.sin()], dim=-1)",
            )
        ],
        [
            "tests/test_rope_scaling.py::test_cos_sin_cache_matches_yarn_in_float64[qwen3]",
            "tests/test_rope_scaling.py::test_greedy_matches_hf_past_the_original_context",
        ],
        "YaRN's cos and sin are not multiplied by its attention factor (0.1 ln(factor) + 1)",
    ),
    Mutation(
        "prefix_cache_evicts_most_recent",
        "python/fastqwen/kvcache/radix_cache.py",
        [
            ("(n.last_access, id(n), n)", "(-n.last_access, id(n), n)"),
            ("(parent.last_access, id(parent), parent)", "(-parent.last_access, id(parent), parent)"),
        ],
        ["tests/test_prefix_cache.py::test_eviction_takes_the_least_recently_used_prefix"],
        "eviction takes the most recently used prefix first",
    ),
]


def mutate(text: str, mutation: Mutation) -> str:
    for old, new in mutation.edits:
        if text.count(old) != 1:
            raise RuntimeError(f"{mutation.name}: the text to mutate occurs {text.count(old)} times in {mutation.path}")
        text = text.replace(old, new)
    return text


def installed_package() -> Path:
    out = subprocess.run(
        [sys.executable, "-c", "import fastqwen, os; print(os.path.dirname(fastqwen.__file__))"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    return Path(out.stdout.strip())


def build_commands(build_dir: Path, source: str) -> tuple[str, str, str]:
    """The build's compile command for csrc/<source>, its link command, and the module's file name."""
    lines = subprocess.run(
        ["ninja", "-C", str(build_dir), "-t", "commands"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    compile_cmd = next(
        line for line in lines if line.rstrip().endswith(f"/csrc/{source}") or f"/csrc/{source} -o" in line
    )
    link = next(line for line in reversed(lines) if " -shared " in line)
    module = link.split(" -o ", 1)[1].split()[0]
    return compile_cmd, link, module


def prepare(mutation: Mutation, package: Path, work: Path, build_dir: Path | None) -> subprocess.Popen | None:
    """The mutant's package copy under work/; for a CUDA mutation, the compile and link started (a Popen)."""
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(package, work / "fastqwen", ignore=shutil.ignore_patterns("__pycache__"))
    if not mutation.cuda:
        target = work / "fastqwen" / Path(mutation.path).relative_to("python/fastqwen")
        target.write_text(mutate(target.read_text(), mutation))
        return None
    assert build_dir is not None, "CUDA mutations need --build-dir"
    shutil.copytree(REPO / "csrc", work / "csrc")  # quoted includes resolve next to the mutated file
    source = Path(mutation.path).name
    mutated = work / "csrc" / source
    mutated.write_text(mutate(mutated.read_text(), mutation))
    build_dir = build_dir.resolve()
    compile_cmd, link, module = build_commands(build_dir, source)
    obj = compile_cmd.split(" -o ", 1)[1].split()[0]  # where the build puts the object (its target's folder)
    compile_cmd = compile_cmd.replace(obj, str(work / f"{source}.o"))
    original = next(t for t in compile_cmd.split() if t.endswith(f"/csrc/{source}"))  # wherever the build read it
    compile_cmd = compile_cmd.replace(original, str(mutated))
    out_module = work / "fastqwen" / Path(module).name
    for existing in (work / "fastqwen").glob("_C*.so"):
        existing.unlink()
    if obj in link:  # the object linked into the module directly
        link = link.replace(obj, str(work / f"{source}.o"))
    else:  # the kernels' static library (CMakeLists.txt): the mutated object goes first, so the linker takes its
        # symbols and never pulls the original member out of the library
        link = link.replace(f" {KERNEL_LIBRARY}", f" {work / f'{source}.o'} {KERNEL_LIBRARY}", 1)
    link = link.replace(f"{build_dir}/{module}", str(out_module)).replace(f" {module}", f" {out_module}")
    log = open(work / "build.log", "w")
    return subprocess.Popen(f"{compile_cmd} && {link}", shell=True, cwd=build_dir, stdout=log, stderr=subprocess.STDOUT)


def run_tests(mutation: Mutation, work: Path) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=f"{work}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    where = subprocess.run(
        [sys.executable, "-c", "import fastqwen; print(fastqwen.__file__)"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not where.startswith(str(work)):
        return "ERROR", f"the mutant is not what imports: {where}"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    lines = (result.stdout + result.stderr).strip().splitlines()
    errors = [line for line in lines if line.startswith("E  ")][:12]  # the assertion that caught it
    tail = "\n".join(errors + lines[-3:])
    verdict = {0: "SURVIVED", 1: "CAUGHT"}.get(result.returncode, f"ERROR (pytest exit {result.returncode})")
    return verdict, tail


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--build-dir", type=Path, default=None)
    p.add_argument("--only", choices=["gpu", "cpu"], default=None, help="only the CUDA (gpu) or Python (cpu) mutants")
    p.add_argument("--work", type=Path, default=Path("/tmp/fastqwen-mutants"))
    p.add_argument("--out", type=Path, default=None, help="write mutations.log here")
    p.add_argument(
        "--phase",
        choices=["all", "build", "test"],
        default="all",
        help="build: only make the mutants (e.g. while other tests use the GPU); test: only test those made",
    )
    args = p.parse_args()
    chosen = [m for m in MUTATIONS if args.only is None or m.cuda == (args.only == "gpu")]
    builds = {}
    if args.phase != "test":
        package = installed_package()
        for mutation in chosen:
            builds[mutation.name] = prepare(mutation, package, args.work / mutation.name, args.build_dir)
    if args.phase == "build":
        failed = [name for name, build in builds.items() if build is not None and build.wait() != 0]
        print(f"built {len(builds) - len(failed)} of {len(builds)} mutants" + (f"; failed: {failed}" if failed else ""))
        return 1 if failed else 0
    lines, caught = [], 0
    for mutation in chosen:
        work = args.work / mutation.name
        build = builds.get(mutation.name)
        built = build.wait() == 0 if build is not None else not mutation.cuda or any((work / "fastqwen").glob("_C*.so"))
        if not built:
            log = work / "build.log"
            verdict, tail = "ERROR (build failed)", log.read_text()[-2000:] if log.exists() else "not built"
        else:
            verdict, tail = run_tests(mutation, work)
        caught += verdict == "CAUGHT"
        lines.append(
            f"== {mutation.name}: {verdict}\n   bug: {mutation.why}\n   tests: {' '.join(mutation.tests)}\n"
            + "\n".join("   | " + t for t in tail.splitlines())
        )
        print(lines[-1], flush=True)
    summary = f"{caught} of {len(chosen)} mutants caught"
    print(summary)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mutations.log").write_text("\n".join(lines + [summary]) + "\n")
    return 0 if caught == len(chosen) else 1


if __name__ == "__main__":
    sys.exit(main())
