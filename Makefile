# Entry points. `make test` is what CI runs (via .ci/run).
BUILD ?= build
JOBS ?= 2

.PHONY: setup configure build test unit pytest e2e demo bench format clean

setup:
	@scripts/setup.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release

configure: $(BUILD)/build.ninja

build: setup configure
	cmake --build $(BUILD) -j $(JOBS)

# Everything: GoogleTest, the Python module's pytest suite, and the official openai npm client
# against `r3 serve`.
test: unit pytest e2e

unit: build
	$(BUILD)/r3_tests --gtest_brief=1

pytest: build
	R3_BUILD=$(BUILD) /usr/bin/python3 -m pytest -q tests/python

e2e: build
	scripts/e2e_openai.sh $(BUILD)

demo: build
	scripts/demo.sh $(BUILD)

bench: build
	scripts/bench.sh $(BUILD)

format:
	clang-format -i $$(git ls-files 'src/*.cc' 'src/*.h' 'tools/*.cc' 'tests/*.cc' 'bench/*.cc')

clean:
	rm -rf $(BUILD)
