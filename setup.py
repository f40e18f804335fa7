"""Build hook: the wheel carries the repository's top-level data directories
(conf/, calibration/, evaluation/) inside the package, as quantlab/_data/<name>,
where quantlab.resources finds them. Editable installs read them in place."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DATA = ("conf", "calibration", "evaluation")


class BuildWithData(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        for name in DATA:
            shutil.copytree(Path(__file__).parent / name, Path(self.build_lib) / "quantlab" / "_data" / name,
                            dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildWithData})
