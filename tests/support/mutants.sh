#!/usr/bin/env bash
# `make mutants`: docs/testing.md's mutation table, run. Each row puts one deliberate bug into the source
# (tests/support/mutate.py), runs the default-run tests named after it and fails if they all pass.
set -uo pipefail
cd "$(dirname "$0")/../.."
survived=0
# mutant FILE OLD NEW TEST...
mutant() {
    local file=$1 old=$2 new=$3; shift 3
    .venv/bin/python tests/support/mutate.py "$file" "$old" "$new" -- \
        .venv/bin/python -m pytest -q -x -p no:cacheprovider --tb=no "$@" > /dev/null || survived=$((survived + 1))
}

mutant lmport/speculative/acceptance.py 'return u * q_d < p_d' 'return u * q_d < 2 * p_d' tests/test_speculative_acceptance.py -k 'not tells'
mutant lmport/speculative/acceptance.py 'r = (p - q).clamp_(min=0.0)' 'r = p.clone()' tests/test_speculative_acceptance.py -k 'not tells'
mutant lmport/speculative/acceptance.py '        r[q] = 0.0' '        pass' tests/test_speculative_acceptance.py -k 'not tells'
mutant lmport/speculative/acceptance.py '        r = p.clone()' '        r = p' tests/test_speculative_acceptance.py -k 'not tells'
mutant lmport/speculative/acceptance.py '    return r if float(r.sum()) > 0 else p' '    return r' tests/test_speculative_acceptance.py -k 'not tells'
mutant lmport/speculative/acceptance.py 'views = [s if j == 0 else' 'views = [s if True else' tests/test_speculative_acceptance.py -k 'not tells'
mutant lmport/speculative/acceptance.py 'float(q[j, d])' 'float(q[0, d])' tests/test_speculative_acceptance.py -k 'not tells'
mutant lmport/speculative/acceptance.py '    last = p[len(proposal)]' '    last = p[0]' tests/test_speculative_acceptance.py -k 'not tells'
mutant lmport/worker/sampling.py 'remove |= ((mass - probs) >= top_p[:, None])' 'remove |= ((mass - probs) > top_p[:, None])' tests/test_sampling_rules.py
mutant lmport/worker/sampling.py 'remove |= probs < (min_p[:, None] * probs[:, :1])' 'remove |= probs < min_p[:, None]' tests/test_sampling_rules.py
mutant lmport/worker/sampling.py 'remove = ranks[None, :] >= k[:, None]' 'remove = ranks[None, :] > k[:, None]' tests/test_sampling_rules.py
mutant lmport/worker/sampling.py 'log_total = torch.where((k < vocab)[:, None], in_k.logsumexp(-1, keepdim=True), log_total)' 'log_total = log_total' tests/test_sampling_rules.py
mutant lmport/worker/sampling.py 'logits[i, seen] = torch.where(values > 0, values / penalty, values * penalty)' 'logits[i, seen] = values / penalty' tests/test_sampling_rules.py
mutant lmport/worker/sampling.py 'logits[rows] -= counts * freq + (counts > 0).float() * presence' 'logits[rows] -= (counts > 0).float() * freq + counts * presence' tests/test_sampling_rules.py
mutant lmport/worker/sampling.py 'rows = logits / torch.tensor([c.temperature' 'rows = logits * torch.tensor([c.temperature' tests/test_sampling_rules.py
mutant lmport/kv/allocator.py $'        else:\n            self._free.append(block)\n        return True' '        return True' tests/test_block_manager.py tests/test_scheduler_random.py
mutant lmport/kv/allocator.py $'        del self._cached[block]\n        self.ref_counts[block] = 1' '        self.ref_counts[block] = 1' tests/test_block_manager.py
mutant lmport/kv/allocator.py '        self.ref_counts[block] += 1' '        self.ref_counts[block] = 2' tests/test_block_manager.py
mutant lmport/kv/block_manager.py $'        else:\n            self.allocator.incref(block)' $'        else:\n            pass' tests/test_block_manager.py
mutant lmport/kv/prefix_cache.py 'and e.tokens == tuple(tokens)' '' tests/test_block_manager.py
mutant lmport/kv/prefix_cache.py 'if e is not None and e.parent is parent and' 'if e is not None and' tests/test_block_manager.py
mutant lmport/kv/prefix_cache.py 'parent = hashes[i - 1] if i else self.seed' 'parent = self.seed' tests/test_block_manager.py
mutant lmport/kv/block_manager.py '            self.allocator.decref(seq.block_table.pop())' '            self.allocator.decref(seq.block_table.pop(), keep=True)' tests/test_block_manager.py
mutant lmport/kv/block_manager.py 'keep = self.blocks_for(seq.num_computed if num_tokens is None else num_tokens)' 'keep = self.blocks_for(seq.num_computed)' tests/test_block_manager.py
mutant lmport/kv/block_manager.py $'            seq.num_computed = 0\n            self.stats["preempt_recompute"] += 1' '            self.stats["preempt_recompute"] += 1' tests/test_block_manager.py tests/test_scheduler_random.py
mutant lmport/sched/scheduler.py $'        seq.status = Status.WAITING\n        seq.num_preemptions += 1' $'        seq.status = Status.WAITING\n        seq.output_ids.clear()\n        seq.num_preemptions += 1' tests/test_scheduler_random.py tests/test_block_manager.py
mutant lmport/sched/scheduler.py '                victim = self.running[-1]' '                victim = self.running[0]' tests/test_scheduler_random.py
mutant lmport/speculative/ngram.py 'start = int(hits[-1]) + n' 'start = int(hits[0]) + n' tests/test_speculative.py -k 'ngram_proposes or grow'
mutant lmport/speculative/speculator.py '            return min(most, length + cls.GROW)' '            return length + cls.GROW' tests/test_speculative.py -k 'ngram_proposes or grow'

echo "$survived mutant(s) survived"
exit $((survived > 0))
