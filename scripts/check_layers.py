#!/usr/bin/env python3
"""Checks that spbcast's includes run one way (docs/internals.md, "Layers"):
  detail/base < detail/wire < detail/transport < detail/orchestration < the public core
  headers (core.hpp) < the training headers the loader's parts stand on (those of spbcast.hpp
  that include no detail/loader header: rng_mirror.hpp, dist.hpp, ...) < detail/loader < the
  training headers built on it (loader.hpp, spbcast.hpp).
A header may include headers of its own layer or of a lower one. A detail header that includes
a public core header (error.hpp, options.hpp: the types every layer speaks) takes that header's
own detail includes with it, so those must sit at its layer or below too. Inside detail/loader
the parts include one way too, in the order of LOADER_PARTS: a part may include only the parts
before it.
  python3 scripts/check_layers.py        exit 1 listing each include that runs the wrong way
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "include" / "spbcast"
DETAIL_LAYERS = ["base", "wire", "transport", "orchestration"]
CORE = len(DETAIL_LAYERS)
TRAINING_BELOW_LOADER = CORE + 1
LOADER = CORE + 2
TRAINING = CORE + 3
LOADER_PARTS = ["stats", "patience", "step_exchange", "resume", "passes", "prefetch"]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def umbrella_members(name):
    return {ROOT / m for m in INCLUDE.findall((ROOT / name).read_text())}


def is_loader_part(path):
    return path.relative_to(ROOT).parts[:2] == ("detail", "loader")


def reaches_loader(path, includes, seen):
    """Whether a header includes a detail/loader header, directly or through other headers."""
    for target in includes.get(path, ()):
        if target in seen:
            continue
        seen.add(target)
        if is_loader_part(target) or reaches_loader(target, includes, seen):
            return True
    return False


def main():
    core = umbrella_members("core.hpp") | {ROOT / "core.hpp"}
    training = (umbrella_members("spbcast.hpp") - core) | {ROOT / "spbcast.hpp"}
    problems = []
    rank = {}
    for path in ROOT.rglob("*.hpp"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "detail":
            if len(rel.parts) == 3 and rel.parts[1] == "loader":
                if path.stem not in LOADER_PARTS:
                    problems.append(f"{rel}: a loader part not in LOADER_PARTS ({', '.join(LOADER_PARTS)})")
                    continue
                rank[path] = LOADER
            elif len(rel.parts) != 3 or rel.parts[1] not in DETAIL_LAYERS:
                problems.append(f"{rel}: a detail header belongs in one of detail/{{{','.join(DETAIL_LAYERS + ['loader'])}}}/")
                continue
            else:
                rank[path] = DETAIL_LAYERS.index(rel.parts[1])
        elif path in core:
            rank[path] = CORE
        elif path in training:
            rank[path] = TRAINING  # until its includes are known
        else:
            problems.append(f"{rel}: a public header that neither core.hpp nor spbcast.hpp includes")
    includes = {p: {(p.parent / t).resolve() for t in INCLUDE.findall(p.read_text())} for p in rank}
    for path in training & rank.keys():
        if not reaches_loader(path, includes, set()):
            rank[path] = TRAINING_BELOW_LOADER

    def detail_reach(path, seen):
        """The highest detail layer a header pulls in, through public headers included on the way."""
        highest = rank[path] if path.relative_to(ROOT).parts[0] == "detail" else -1
        for target in includes[path]:
            if target in rank and target not in seen:
                seen.add(target)
                highest = max(highest, detail_reach(target, seen))
        return highest

    for path, own in sorted(rank.items()):
        rel = path.relative_to(ROOT)
        for target in sorted(includes[path]):
            if target not in rank:
                problems.append(f"{rel}: includes {target}, which is not a spbcast header")
                continue
            reach = rank[target]
            if rel.parts[0] == "detail" and target.relative_to(ROOT).parts[0] != "detail":
                reach = max(detail_reach(target, set()), -1)
                if target in training:
                    reach = rank[target]
            if reach > own:
                problems.append(f"{rel}: includes {target.relative_to(ROOT)}, which runs the wrong way")
            elif is_loader_part(path) and is_loader_part(target) and \
                    LOADER_PARTS.index(target.stem) >= LOADER_PARTS.index(path.stem):
                problems.append(f"{rel}: includes {target.relative_to(ROOT)}, a loader part at or after "
                                f"its own in LOADER_PARTS")
    for layer in DETAIL_LAYERS + ["loader"]:
        if not (ROOT / "detail" / layer / "README.md").exists():
            problems.append(f"detail/{layer}/: no README.md saying what the layer owns")
    for problem in problems:
        print(problem)
    print(f"check_layers: {len(rank)} headers, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
