// The translation unit that compiles the precompiled LibTorch headers of this build tree
// (cmake/PrecompiledTorch.cmake); the tree's programs reuse them.
