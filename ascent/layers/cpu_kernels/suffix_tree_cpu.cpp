// Native suffix tree for suffix decoding: the same structure, operations and results as the Python
// ``ascent.spec_decode.suffix_tree.SuffixTree`` (whose docstring states the semantics), without its per-token
// interpreter cost (indexing a prompt walks up to ``max_depth`` active suffixes per token).
//
// A depth-bounded, path-compressed suffix trie over several token sequences: every suffix of every sequence is
// inserted up to ``max_depth`` tokens; a node covers ``length`` tokens read from ``(*ref)[ref_idx ..]`` (a stored
// sequence, shared with the nodes that point into it, or a private copy) and counts the occurrences of its string.
// Sequences are shared_ptr-owned so a node pointing into a removed sequence keeps reading it, as a Python list
// reference would. Nodes live in a deque (stable references) with a free list.
//
// Children are kept sorted by token (binary search; the highest-count child with the smallest token is the first
// maximum of a scan). Sequence ids are int64 (the Python wrapper maps hashable ids to them).
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace ascent_suffix {

using Tokens = std::vector<int32_t>;
using Seq = std::shared_ptr<Tokens>;
constexpr int32_t kRoot = 0;
constexpr int32_t kNone = -1;

struct Node {
  int32_t token = -1;
  int64_t count = 0;
  int32_t length = 0;
  Seq ref;
  int32_t ref_idx = 0;
  int32_t parent = kNone;
  std::vector<std::pair<int32_t, int32_t>> children;  // (token, node), sorted by token
};

struct Draft {
  Tokens tokens;
  std::vector<double> probs;
  double score = 0.0;
};

class SuffixTree {
 public:
  explicit SuffixTree(int64_t max_depth) : max_depth_(max_depth) {
    if (max_depth < 1) throw std::invalid_argument("max_depth=" + std::to_string(max_depth) + " is invalid: must be >= 1");
    nodes_.emplace_back();
    nodes_[kRoot].ref = std::make_shared<Tokens>();
  }

  int64_t max_depth() const { return max_depth_; }

  // Append one token to sequence seq_id (created on first use): a new suffix starts at the root, every active suffix
  // grows by the token and the oldest stops once it is max_depth long.
  void append(int64_t seq_id, int32_t token) {
    Seq& seq_slot = seqs_[seq_id];
    if (!seq_slot) seq_slot = std::make_shared<Tokens>();
    const Seq seq = seq_slot;
    std::deque<int32_t>& active = active_[seq_id];
    active.push_back(kRoot);
    nodes_[kRoot].count += 1;
    if (static_cast<int64_t>(active.size()) > max_depth_) active.pop_front();
    seq->push_back(token);
    const int32_t end = static_cast<int32_t>(seq->size());
    for (size_t i = 0; i < active.size(); ++i) active[i] = grow(active[i], token, seq, end);
  }

  void extend(int64_t seq_id, const Tokens& tokens) {
    for (int32_t t : tokens) append(seq_id, t);
  }

  // extend() for several sequences in one call (one decode step's new tokens of every running request).
  void extend_many(const std::vector<int64_t>& seq_ids, const std::vector<Tokens>& tokens) {
    if (seq_ids.size() != tokens.size()) throw std::invalid_argument("extend_many: seq_ids and tokens differ in length");
    for (size_t i = 0; i < seq_ids.size(); ++i) extend(seq_ids[i], tokens[i]);
  }

  // Forget sequence seq_id (unknown ids are ignored).
  void remove(int64_t seq_id) {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) return;
    const Seq seq = it->second;
    seqs_.erase(it);
    active_.erase(seq_id);
    for (size_t start = 0; start < seq->size(); ++start) remove_suffix(seq, start);
  }

  int64_t count(const Tokens& pattern) const {
    if (pattern.empty() || static_cast<int64_t>(pattern.size()) > max_depth_) return 0;
    int32_t node;
    int32_t idx;
    return match(pattern.data(), pattern.size(), &node, &idx) ? nodes_[node].count : 0;
  }

  // Best chain draft continuing ctx (see the Python docstring): (tokens, probs, score, match_len).
  py::tuple speculate(const Tokens& ctx, int64_t max_spec_tokens, double factor, double offset, double min_prob,
                      bool has_seq, int64_t seq_id) const {
    const std::deque<int32_t>* ends = has_seq ? tail_suffix_ends(ctx, seq_id) : nullptr;
    Draft best;
    int64_t best_m = 0;
    const size_t n = ctx.size();
    for (size_t m = 1; m < n; ++m) {
      int32_t node;
      int32_t idx;
      if (ends != nullptr) {
        node = (*ends)[ends->size() - m];
        idx = nodes_[node].length;
      } else if (!match(ctx.data() + (n - m), m, &node, &idx)) {
        break;
      }
      const Node& at = nodes_[node];
      if (idx >= at.length && at.children.empty()) {  // nothing ever followed this suffix: an empty draft
        if (best.score <= 0.0) {
          best = Draft();
          best_m = static_cast<int64_t>(m);
        }
        continue;
      }
      const int64_t by_match = static_cast<int64_t>(static_cast<double>(m) * factor + offset + 1e-6);
      const int64_t cap = std::max<int64_t>(0, std::min(max_spec_tokens, by_match));
      Draft draft = walk(node, idx, cap, min_prob);
      if (draft.score >= best.score) {
        best = std::move(draft);
        best_m = static_cast<int64_t>(m);
      }
    }
    return py::make_tuple(best.tokens, best.probs, best.score, best_m);
  }

  // Structural invariants (for tests): parent links, labels, counts and depth; throws on a violation.
  void check_integrity() const {
    std::vector<std::pair<int32_t, int64_t>> stack{{kRoot, 0}};
    while (!stack.empty()) {
      const auto [id, depth] = stack.back();
      stack.pop_back();
      const Node& node = nodes_[id];
      require(depth <= max_depth_, "depth over max_depth");
      int64_t total = 0;
      int32_t previous = INT32_MIN;
      for (const auto& [tok, cid] : node.children) {
        const Node& child = nodes_[cid];
        require(tok > previous, "children not sorted");
        previous = tok;
        require(child.parent == id && child.token == tok && child.length >= 1, "bad child link");
        require(child.ref && child.ref_idx >= 0 && child.ref_idx + child.length <= static_cast<int64_t>(child.ref->size()),
                "label out of range");
        require((*child.ref)[child.ref_idx] == tok, "label does not start with the child's token");
        require(child.count > 0 && (id == kRoot || child.count < node.count), "bad count");
        total += child.count;
        stack.emplace_back(cid, depth + child.length);
      }
      require(total <= node.count, "children count more than their parent");
    }
  }

  std::vector<int64_t> seq_ids() const {
    std::vector<int64_t> ids;
    for (const auto& [id, seq] : seqs_) ids.push_back(id);
    return ids;
  }

  Tokens sequence(int64_t seq_id) const {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) throw std::out_of_range("unknown sequence " + std::to_string(seq_id));
    return *it->second;
  }

 private:
  int64_t max_depth_;
  std::deque<Node> nodes_;
  std::vector<int32_t> free_;
  std::unordered_map<int64_t, Seq> seqs_;
  std::unordered_map<int64_t, std::deque<int32_t>> active_;  // per sequence: the nodes its last <= D suffixes end at

  static void require(bool ok, const char* what) {
    if (!ok) throw std::runtime_error(std::string("suffix tree integrity: ") + what);
  }

  int32_t token_at(const Node& node, int32_t i) const { return (*node.ref)[node.ref_idx + i]; }

  int32_t find_child(int32_t id, int32_t token) const {
    const auto& ch = nodes_[id].children;
    auto it = std::lower_bound(ch.begin(), ch.end(), std::make_pair(token, INT32_MIN));
    return (it != ch.end() && it->first == token) ? it->second : kNone;
  }

  void set_child(int32_t id, int32_t token, int32_t child) {
    auto& ch = nodes_[id].children;
    auto it = std::lower_bound(ch.begin(), ch.end(), std::make_pair(token, INT32_MIN));
    if (it != ch.end() && it->first == token) {
      it->second = child;
    } else {
      ch.insert(it, {token, child});
    }
  }

  void erase_child(int32_t id, int32_t token) {
    auto& ch = nodes_[id].children;
    auto it = std::lower_bound(ch.begin(), ch.end(), std::make_pair(token, INT32_MIN));
    if (it != ch.end() && it->first == token) ch.erase(it);
  }

  int32_t new_node(int32_t token, int64_t count, int32_t length, const Seq& ref, int32_t ref_idx, int32_t parent) {
    int32_t id;
    if (!free_.empty()) {
      id = free_.back();
      free_.pop_back();
    } else {
      id = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
    }
    Node& node = nodes_[id];
    node.token = token;
    node.count = count;
    node.length = length;
    node.ref = ref;
    node.ref_idx = ref_idx;
    node.parent = parent;
    node.children.clear();
    return id;
  }

  void release(int32_t id) {
    Node& node = nodes_[id];
    node.ref.reset();
    node.children.clear();
    node.children.shrink_to_fit();
    node.parent = kNone;
    free_.push_back(id);
  }

  void release_subtree(int32_t id) {
    std::vector<int32_t> stack{id};
    while (!stack.empty()) {
      const int32_t cur = stack.back();
      stack.pop_back();
      for (const auto& [tok, cid] : nodes_[cur].children) stack.push_back(cid);
      release(cur);
    }
  }

  static void point_at(Node& node, const Seq& seq, int32_t end) {
    node.ref = seq;
    node.ref_idx = end - node.length;
  }

  void drop_first_token(Node& node) {
    node.length -= 1;
    node.ref_idx += 1;
    node.token = (*node.ref)[node.ref_idx];
  }

  Seq label(const Node& node) const {
    return std::make_shared<Tokens>(node.ref->begin() + node.ref_idx, node.ref->begin() + node.ref_idx + node.length);
  }

  // Extend the suffix ending at node by token (now at (*seq)[end - 1]); returns its new end node.
  int32_t grow(int32_t id, int32_t token, const Seq& seq, int32_t end) {
    const int32_t cid = find_child(id, token);
    Node& node = nodes_[id];
    if (cid == kNone) {
      if (id != kRoot && node.count == 1) {  // only this suffix reaches the leaf: lengthen it
        node.length += 1;
        point_at(node, seq, end);
        return id;
      }
      const int32_t added = new_node(token, 1, 1, seq, end - 1, id);
      set_child(id, token, added);
      return added;
    }
    Node& child = nodes_[cid];
    if (id != kRoot && node.count == child.count + 1) {  // this suffix is the only one ending at node
      if (child.length == 1) return fuse_into_child(id, cid, seq, end);
      node.length += 1;
      point_at(node, seq, end);
      erase_child(id, token);
      drop_first_token(child);
      set_child(id, child.token, cid);
      return id;
    }
    if (child.length == 1) {  // one more occurrence
      child.count += 1;
      point_at(child, seq, end);
      return cid;
    }
    const int32_t mid = new_node(token, child.count + 1, 1, seq, end - 1, id);
    drop_first_token(child);
    child.parent = mid;
    set_child(mid, child.token, cid);
    set_child(id, token, mid);
    return mid;
  }

  int32_t fuse_into_child(int32_t id, int32_t cid, const Seq& seq, int32_t end) {
    Node& node = nodes_[id];
    Node& child = nodes_[cid];
    const int32_t parent = node.parent;
    child.token = node.token;
    child.count += 1;
    child.length = node.length + 1;
    point_at(child, seq, end);
    child.parent = parent;
    set_child(parent, child.token, cid);
    release(id);
    return cid;
  }

  void remove_suffix(const Seq& seq, size_t start) {
    int32_t id = kRoot;
    nodes_[kRoot].count -= 1;
    size_t idx = start;
    while (idx < seq->size()) {
      const int32_t cid = find_child(id, (*seq)[idx]);
      if (cid == kNone) break;
      Node& child = nodes_[cid];
      child.count -= 1;
      if (child.count == 0) {
        erase_child(id, child.token);
        release_subtree(cid);
        break;
      }
      if (child.ref == seq) {
        child.ref = label(child);
        child.ref_idx = 0;
      }
      idx += child.length;
      id = cid;
    }
    if (id != kRoot && nodes_[id].children.size() == 1) {
      const int32_t only = nodes_[id].children.front().second;
      if (nodes_[only].count == nodes_[id].count) merge_with_child(id, only);
    }
  }

  void merge_with_child(int32_t id, int32_t cid) {
    Node& node = nodes_[id];
    Node& child = nodes_[cid];
    const int32_t parent = node.parent;
    auto merged = std::make_shared<Tokens>(node.ref->begin() + node.ref_idx,
                                           node.ref->begin() + node.ref_idx + node.length);
    merged->insert(merged->end(), child.ref->begin() + child.ref_idx,
                   child.ref->begin() + child.ref_idx + child.length);
    child.ref = merged;
    child.ref_idx = 0;
    child.length += node.length;
    child.token = node.token;
    child.parent = parent;
    set_child(parent, child.token, cid);
    release(id);
  }

  // Walk pattern from the root: the node and tokens consumed in it, or false when it does not occur.
  bool match(const int32_t* pattern, size_t n, int32_t* out_node, int32_t* out_idx) const {
    int32_t id = kRoot;
    int32_t idx = 0;
    for (size_t i = 0; i < n; ++i) {
      const int32_t t = pattern[i];
      if (idx >= nodes_[id].length) {
        const int32_t next = find_child(id, t);
        if (next == kNone) return false;
        id = next;
        idx = 0;
      }
      if (token_at(nodes_[id], idx) != t) return false;
      idx += 1;
    }
    *out_node = id;
    *out_idx = idx;
    return true;
  }

  // The end nodes of sequence seq_id's last suffixes ([size - m]: length m) when its tail is ctx.
  const std::deque<int32_t>* tail_suffix_ends(const Tokens& ctx, int64_t seq_id) const {
    if (ctx.empty()) return nullptr;
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) return nullptr;
    const Tokens& seq = *it->second;
    if (seq.size() < ctx.size() || !std::equal(ctx.begin(), ctx.end(), seq.end() - ctx.size())) return nullptr;
    auto act = active_.find(seq_id);
    if (act == active_.end() || act->second.size() + 1 < ctx.size()) return nullptr;
    return &act->second;
  }

  int32_t best_child(const Node& node) const {
    int32_t best = kNone;
    int64_t best_count = 0;
    for (const auto& [tok, cid] : node.children) {  // ascending tokens: ties keep the smallest
      if (best == kNone || nodes_[cid].count > best_count) {
        best = cid;
        best_count = nodes_[cid].count;
      }
    }
    return best;
  }

  Draft walk(int32_t id, int32_t idx, int64_t max_tokens, double min_prob) const {
    Draft d;
    double prob = 1.0;
    while (static_cast<int64_t>(d.tokens.size()) < max_tokens && prob >= min_prob) {
      const Node& node = nodes_[id];
      if (idx < node.length) {
        d.tokens.push_back(token_at(node, idx));
        d.probs.push_back(prob);
        d.score += prob;
        idx += 1;
        continue;
      }
      const int32_t child = best_child(node);
      if (child == kNone) break;
      prob *= static_cast<double>(nodes_[child].count) / static_cast<double>(node.count);
      id = child;
      idx = 0;
    }
    return d;
  }
};

}  // namespace ascent_suffix

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using ascent_suffix::SuffixTree;
  py::class_<SuffixTree>(m, "SuffixTree")
      .def(py::init<int64_t>(), py::arg("max_depth"))
      .def_property_readonly("max_depth", &SuffixTree::max_depth)
      .def("append", &SuffixTree::append, py::arg("seq_id"), py::arg("token"))
      .def("extend", &SuffixTree::extend, py::arg("seq_id"), py::arg("tokens"))
      .def("extend_many", &SuffixTree::extend_many, py::arg("seq_ids"), py::arg("tokens"))
      .def("remove", &SuffixTree::remove, py::arg("seq_id"))
      .def("count", &SuffixTree::count, py::arg("pattern"))
      .def("speculate", &SuffixTree::speculate, py::arg("ctx"), py::arg("max_spec_tokens"), py::arg("factor"),
           py::arg("offset"), py::arg("min_prob"), py::arg("has_seq"), py::arg("seq_id"),
           "(tokens, probs, score, match_len) of the best chain draft continuing ctx")
      .def("check_integrity", &SuffixTree::check_integrity)
      .def("seq_ids", &SuffixTree::seq_ids)
      .def("sequence", &SuffixTree::sequence, py::arg("seq_id"));
}
