"""Print the declared floor of every dependency as an exact pin (`name==floor`), read from pyproject.toml:
the constraints of CI's floor job, so the versions it tests are the ones pyproject.toml declares.
With --requirements: the requirements themselves instead (self-references such as causal_adapter[serve]
expanded), so the floor job can install the dependencies before the project (.ci/run).
Usage: python .ci/floors.py [--requirements] [extra ...] > floors.txt"""
import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
args = sys.argv[1:]
as_requirements = "--requirements" in args
extras = [a for a in args if a != "--requirements"]
requirements = list(project["dependencies"])
while extras:
    for requirement in project["optional-dependencies"][extras.pop(0)]:
        own = re.match(rf"^{project['name']}\[([^\]]*)\]$", requirement.replace(" ", ""))
        if own:  # the project's own extras, e.g. dev = ["causal_adapter[serve]", ...]
            extras += own.group(1).split(",")
        else:
            requirements.append(requirement)
for requirement in dict.fromkeys(requirements):
    if as_requirements:
        print(requirement)
        continue
    floor = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)", requirement)
    if floor:
        print(f"{floor.group(1)}=={floor.group(3)}")
