"""Print the digest of every upstream source behind the package's shortcuts, for the installed transformers.

    python3 scripts/source_digests.py

When the drift test reports a shortcut's source as unknown on a new release: read that source against the
shortcut's code (the docstring names what it copies), and if the behaviour is unchanged, add the digest printed here
to `targets.SHORTCUTS` with the release it was read in.
"""

import transformers

from transformers_async_stop.release_checks import verified
from transformers_async_stop.release_checks.targets import SHORTCUTS, present_in

version = tuple(int(x) for x in transformers.__version__.split(".")[:2])
print(f"transformers {transformers.__version__}")
for shortcut in SHORTCUTS:
    claimed = present_in(shortcut, version)
    print(f"\n{shortcut.name} (claims {shortcut.present}: {'yes' if claimed else 'no'}; "
          f"taken here: {verified.matches(shortcut.name)})")
    for source, digest in verified.installed_digests(shortcut.name).items():
        known = shortcut.digests.get(source, {}).get(digest)
        print(f"  {digest}  {source}  {'(listed: ' + known + ')' if known else '(NOT LISTED)'}")
