#include "page_allocator.h"

#include <algorithm>
#include <stdexcept>

namespace fastqwen {

namespace {
std::string page_str(int64_t p) { return std::to_string(p); }
}  // namespace

PageAllocator::PageAllocator(int64_t num_pages) {
  if (num_pages < 1) {
    throw std::invalid_argument("PageAllocator: num_pages must be >= 1, got " + std::to_string(num_pages));
  }
  if (num_pages > INT32_MAX) {
    throw std::invalid_argument("PageAllocator: num_pages too large: " + std::to_string(num_pages));
  }
  refcount_.assign(static_cast<size_t>(num_pages), 0);
  mark_.assign(static_cast<size_t>(num_pages), 0);
  count_.assign(static_cast<size_t>(num_pages), 0);
  reset();
}

void PageAllocator::reset() {
  const int64_t n = num_total();
  std::fill(refcount_.begin(), refcount_.end(), 0);
  free_stack_.clear();
  free_stack_.reserve(static_cast<size_t>(n));
  // Stack: push high ids first so the lowest ids are allocated first.
  for (int64_t p = n - 1; p >= 0; --p) free_stack_.push_back(static_cast<int32_t>(p));
}

void PageAllocator::check_range(int64_t page) const {
  if (page < 0 || page >= num_total()) {
    throw std::out_of_range("page " + page_str(page) + " out of range [0, " + std::to_string(num_total()) + ")");
  }
}

void PageAllocator::next_epoch() {
  if (++epoch_ == 0) {  // wrapped (practically never): clear the marks
    std::fill(mark_.begin(), mark_.end(), 0);
    epoch_ = 1;
  }
}

std::optional<std::vector<int64_t>> PageAllocator::alloc(int64_t n) {
  if (n < 0) throw std::invalid_argument("alloc: n must be >= 0, got " + std::to_string(n));
  if (n > num_free()) return std::nullopt;
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t p = free_stack_.back();
    free_stack_.pop_back();
    refcount_[p] = 1;
    out.push_back(p);
  }
  return out;
}

void PageAllocator::free(const std::vector<int64_t>& pages) {
  // Validate everything first.
  for (int64_t p : pages) check_range(p);
  next_epoch();
  for (int64_t p : pages) {
    const int64_t rc = refcount_[p];
    if (rc == 0) throw std::invalid_argument("double free of page " + page_str(p));
    if (rc > 1) {
      throw std::invalid_argument("free of shared page " + page_str(p) + " (refcount " + std::to_string(rc) +
                                  "); use decref");
    }
    if (mark_[p] == epoch_) throw std::invalid_argument("page " + page_str(p) + " appears twice in free()");
    mark_[p] = epoch_;
  }
  // Apply. Push in reverse so that a following alloc returns them in list order.
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
    refcount_[*it] = 0;
    free_stack_.push_back(static_cast<int32_t>(*it));
  }
}

void PageAllocator::incref(const std::vector<int64_t>& pages) {
  for (int64_t p : pages) check_range(p);
  for (int64_t p : pages) {
    if (refcount_[p] == 0) throw std::invalid_argument("incref of free page " + page_str(p));
  }
  for (int64_t p : pages) ++refcount_[p];
}

std::vector<int64_t> PageAllocator::decref(const std::vector<int64_t>& pages) {
  for (int64_t p : pages) check_range(p);
  next_epoch();
  for (int64_t p : pages) {
    if (mark_[p] != epoch_) {
      mark_[p] = epoch_;
      count_[p] = 0;
    }
    ++count_[p];
    if (count_[p] > refcount_[p]) {
      if (refcount_[p] == 0) throw std::invalid_argument("double free of page " + page_str(p) + " (decref of a free page)");
      throw std::invalid_argument("double free of page " + page_str(p) + ": decref " + std::to_string(count_[p]) +
                                  " times but refcount is " + std::to_string(refcount_[p]));
    }
  }
  std::vector<int64_t> freed;
  for (int64_t p : pages) {
    if (--refcount_[p] == 0) {
      freed.push_back(p);
    }
  }
  for (auto it = freed.rbegin(); it != freed.rend(); ++it) free_stack_.push_back(static_cast<int32_t>(*it));
  return freed;
}

int64_t PageAllocator::refcount(int64_t page) const {
  check_range(page);
  return refcount_[page];
}

std::vector<int64_t> PageAllocator::refcount_mismatches(const std::vector<int64_t>& owners) const {
  std::vector<int64_t> held(refcount_.size(), 0);
  for (int64_t p : owners) {
    check_range(p);
    ++held[static_cast<size_t>(p)];
  }
  std::vector<int64_t> out;
  for (size_t p = 0; p < refcount_.size(); ++p) {
    if (refcount_[p] != held[p]) out.push_back(static_cast<int64_t>(p));
  }
  return out;
}

void PageAllocator::check() const {
  const int64_t n = num_total();
  if (num_free() > n) {
    throw std::runtime_error("allocator invariant violated: free list holds " + std::to_string(num_free()) +
                             " entries but there are only " + std::to_string(n) + " pages");
  }
  std::vector<uint8_t> in_free(static_cast<size_t>(n), 0);
  for (int32_t p : free_stack_) {
    if (p < 0 || p >= n) {
      throw std::runtime_error("allocator invariant violated: free list holds out-of-range page " + page_str(p));
    }
    if (in_free[p]) throw std::runtime_error("allocator invariant violated: page " + page_str(p) + " is in the free list twice");
    in_free[p] = 1;
    if (refcount_[p] != 0) {
      throw std::runtime_error("allocator invariant violated: page " + page_str(p) + " is in the free list with refcount " +
                               std::to_string(refcount_[p]));
    }
  }
  int64_t referenced = 0;
  for (int64_t p = 0; p < n; ++p) {
    if (refcount_[p] < 0) {
      throw std::runtime_error("allocator invariant violated: page " + page_str(p) + " has negative refcount " +
                               std::to_string(refcount_[p]));
    }
    if (refcount_[p] == 0 && !in_free[p]) {
      throw std::runtime_error("allocator invariant violated: page " + page_str(p) + " has refcount 0 but is not in the free list (leaked)");
    }
    if (refcount_[p] > 0) ++referenced;
  }
  if (referenced + num_free() != n) {
    throw std::runtime_error("allocator invariant violated: free (" + std::to_string(num_free()) + ") + referenced (" +
                             std::to_string(referenced) + ") != total (" + std::to_string(n) + ")");
  }
}

std::string PageAllocator::repr() const {
  return "PageAllocator(num_total=" + std::to_string(num_total()) + ", num_free=" + std::to_string(num_free()) +
         ", num_used=" + std::to_string(num_used()) + ")";
}

}  // namespace fastqwen
