# The two commands of README.md. Both install what is missing first (scripts/bootstrap.sh).
#   make demo   builds kvcompd and the Python extension only, in build-demo (CPU backend, no
#               debug information), and runs the main job on the embedded defaults (no GPU
#               needed), each step with its time
#   make test   builds everything and runs every test that can run here (README.md, "Tests"),
#               then prints passed, skipped (with reasons) and failed per section
BUILD ?= build
# make demo's own build directory: CPU backend only, no debug information (scripts/demo.sh)
DEMO_BUILD ?= build-demo
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=
PYTHON ?= python3

.PHONY: all bootstrap configure build test test-cpp test-sanitize test-fuzz test-python demo clean format

all: build

bootstrap:
	@bash scripts/bootstrap.sh

configure: bootstrap
	@cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo $(CMAKE_ARGS) >/dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

test: build
	@bash scripts/run_tests.sh $(BUILD)

demo:
	@JOBS=$(JOBS) CMAKE_ARGS="$(CMAKE_ARGS)" bash scripts/demo.sh $(DEMO_BUILD)

format:
	@git ls-files '*.h' '*.cc' '*.cu' '*.cuh' | xargs clang-format -i

clean:
	rm -rf $(BUILD) $(DEMO_BUILD) build-asan build-fuzz build-tsan-storage build-asan-storage \
	  build-asan-transport build-ucx122 build-gpu
