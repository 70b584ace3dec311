"""Expert parallelism and expert stacks: the stacks' declarations, the seams where experts run, the token dispatch, the split of a stack over owners, its communication."""
