"""The porting report for the installed transformers: what a new release changed under the package.

    python scripts/drift_report.py            # the report; exit status 1 when anything needs porting
    python scripts/drift_report.py --digests  # also every source digest (scripts/source_digests.py's listing)

It says whether the release is newer than the newest one the package was checked against
(`release_notice.NEWEST_CHECKED`), which patch targets are missing or lost a parameter their replacement relies on,
which shortcuts (fast paths) are off and which of their upstream sources changed (with the releases the table last
read them in, to diff against), and what the user is warned. To port: read each changed source against the code
that copies it (its "Copied from ..." docstring names it); if the behaviour is unchanged, list the new digest in
`targets/shortcuts.py` with the release; else port the copy, say the differences, and add the digest. Then run
`tests/test_patching.py` and the core tests (`nox -s newest` does all of it).
"""

from __future__ import annotations

import argparse
import inspect
import sys

from transformers_async_stop import patching
from transformers_async_stop.release_checks import release_notice, verified
from transformers_async_stop.release_checks.targets import SHORTCUTS, TARGETS, present_in


def _last_read(digests: dict) -> str:
    """The newest release range a source's table lists ("5.18.0-5.23.0"), to diff the new source against."""
    def key(releases: str):
        last = releases.split("-")[-1]
        return tuple(int(part) for part in last.split(".") if part.isdigit())
    return max(digests.values(), key=key) if digests else "none"


def target_problems(version) -> list[str]:
    problems = []
    for target in TARGETS:
        expected = present_in(target, version)
        original = patching.original(target.name)
        if expected and original is None:
            problems.append(f"missing: {target.name} ({target.why})")
        elif expected is False and original is not None:
            problems.append(f"back, though the table says it left after {target.present}: {target.name}")
        elif expected and target.params:
            params = inspect.signature(original.__init__ if inspect.isclass(original) else original).parameters
            lost = [p for p in target.params if not any(name in params for name in p.split("|"))]
            if lost:
                problems.append(f"{target.name} lost parameters {lost}")
    return problems


def changed_sources(version) -> dict[str, list[str]]:
    """Upstream source -> the shortcuts claimed on `version` that read it and do not list its installed digest."""
    changed: dict[str, list[str]] = {}
    for shortcut in SHORTCUTS:
        if not present_in(shortcut, version):
            continue
        for source, digest in verified.installed_digests(shortcut.name).items():
            if digest not in shortcut.digests.get(source, {}):
                changed.setdefault(source, []).append(shortcut.name)
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--digests", action="store_true", help="also list every source digest")
    args = parser.parse_args(argv)

    full = release_notice.installed_version()
    version = tuple(full)[:2]
    checked = ".".join(map(str, release_notice.NEWEST_CHECKED))
    print(f"transformers {release_notice.installed_release()} (newest checked: {checked}; "
          f"{'NEWER' if release_notice.is_newer(full) else 'checked range'})")

    problems = target_problems(version)
    print(f"\npatch targets: {len(TARGETS) - len(problems)} of {len(TARGETS)} as the table says")
    for line in problems:
        print(f"  {line}")

    off = release_notice.fast_paths_off(full)
    print(f"\nfast paths off here: {len(off)}")
    for name in off:
        print(f"  {name}")

    changed = changed_sources(version)
    by_source = {source: shortcut.digests.get(source, {}) for shortcut in SHORTCUTS for source in shortcut.sources}
    print(f"\nchanged upstream sources: {len(changed)}")
    for source, names in sorted(changed.items()):
        digest = verified.installed_digests(names[0])[source]
        print(f"  {source}  now {digest}, last read in {_last_read(by_source.get(source, {}))}")
        print(f"      read by: {', '.join(names)}")

    text = release_notice.notice_text(full, off)
    print("\nwhat a flagged call warns (once per process):")
    print(f"  {text}" if text else "  nothing")

    if args.digests:
        print()
        for shortcut in SHORTCUTS:
            print(f"{shortcut.name} (claims {shortcut.present}; taken here: {verified.matches(shortcut.name)})")
            for source, digest in verified.installed_digests(shortcut.name).items():
                known = shortcut.digests.get(source, {}).get(digest)
                print(f"  {digest}  {source}  {'(listed: ' + known + ')' if known else '(NOT LISTED)'}")
    return 1 if problems or off or release_notice.is_newer(full) else 0


if __name__ == "__main__":
    sys.exit(main())
