// SPDX-License-Identifier: Apache-2.0
// Must not compile: head_dim 96 is not supported.
#include "stria/core/tile.hpp"
int main() { return stria::tile<64, 64, 96>::head_dim; }
