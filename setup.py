"""Packaging beyond pyproject.toml: the bundled recipes (apps/configs/*.yaml, their one home
in the repository) go into the wheel as troupe/recipes/, where ``troupe --config NAME``
finds them once troupe is installed without its checkout."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithRecipes(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "troupe" / "recipes"
        target.mkdir(parents=True, exist_ok=True)
        for recipe in sorted(Path(__file__).parent.joinpath("apps", "configs").glob("*.yaml")):
            shutil.copy(recipe, target / recipe.name)


setup(cmdclass={"build_py": BuildWithRecipes})
