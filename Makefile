# Entry points. `make test` is what CI runs (via .ci/run).
BUILD ?= build
JOBS ?= 2

.PHONY: setup configure build test demo bench format clean

setup:
	@scripts/setup.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release

configure: $(BUILD)/build.ninja

build: setup configure
	cmake --build $(BUILD) -j $(JOBS)

test: build
	$(BUILD)/r3_tests --gtest_brief=1

demo: build
	scripts/demo.sh $(BUILD)

bench: build
	scripts/bench.sh $(BUILD)

format:
	clang-format -i $$(git ls-files 'src/*.cc' 'src/*.h' 'tools/*.cc' 'tests/*.cc' 'bench/*.cc')

clean:
	rm -rf $(BUILD)
