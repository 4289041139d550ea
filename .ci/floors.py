"""Print the declared floor of every dependency as an exact pin (`name==floor`), read from pyproject.toml:
the constraints of CI's floor job, so the versions it tests are the ones pyproject.toml declares.
Usage: python .ci/floors.py [extra ...] > floors.txt"""
import re
import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
requirements = list(project["dependencies"])
for extra in sys.argv[1:]:
    requirements += project["optional-dependencies"][extra]
for requirement in requirements:
    floor = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*)", requirement)
    if floor:
        print(f"{floor.group(1)}=={floor.group(3)}")
