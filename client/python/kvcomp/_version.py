"""The kvcomp package's version: the wheel's (pyproject.toml reads it from here), kvcompd's
(service/src/config.cc) and the C++ project's (CMakeLists.txt), which a test keeps equal."""

__version__ = "0.1.0"
