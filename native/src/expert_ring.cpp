#include "mosaic/expert_ring.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <new>
#include <stdexcept>
#include <string>

#include "mosaic/crc32.h"
#include "mosaic/vault_format.h"

namespace mosaic {

ExpertRing::ExpertRing(int direct_fd, int buffered_fd, uint64_t n_slots, uint64_t slot_bytes, int io_threads,
                       bool verify)
    : direct_fd_(direct_fd), buffered_fd_(buffered_fd), n_slots_(n_slots), slot_bytes_(slot_bytes),
      states_(new std::atomic<int32_t>[n_slots]), failures_(new ReadFailure[n_slots]), verify_(verify) {
  demand_.items.resize(n_slots);
  // A cancelled background request stays queued, stale, until a worker pops and skips it: room for one
  // stale and one live request per slot.
  background_.items.resize(2 * n_slots);
  latest_.assign(n_slots, Request{0, 0, 0, 0, 0});
  taken_.assign(n_slots, true);
  demand_generation_.assign(n_slots, 0);
  if (n_slots == 0 || slot_bytes == 0 || slot_bytes % 4096 != 0)
    throw std::invalid_argument("ExpertRing: need at least one slot of a whole number of 4 KiB pages");
  // Anonymous mmap: page-aligned (Direct I/O needs it), allocated once for the ring's life.
  void* p = mmap(nullptr, n_slots * slot_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  // Transparent huge pages where the system allows them (THP "madvise" mode): the expert kernels stream
  // whole records, and 2 MiB pages spare them a TLB miss every 4 KiB. Advice only: failure is harmless.
  madvise(p, n_slots * slot_bytes, MADV_HUGEPAGE);
#endif
  memory_ = static_cast<uint8_t*>(p);
  for (uint64_t i = 0; i < n_slots; ++i) states_[i].store(0);
  for (int t = 0; t < (io_threads > 0 ? io_threads : 1); ++t) threads_.emplace_back(&ExpertRing::worker, this);
}

ExpertRing::~ExpertRing() {
  shutdown();
  munmap(memory_, n_slots_ * slot_bytes_);
}

void ExpertRing::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  work_cv_.notify_all();
  done_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
  if (direct_fd_ >= 0) close(direct_fd_);
  if (buffered_fd_ >= 0) close(buffered_fd_);
  direct_fd_ = buffered_fd_ = -1;
}

void ExpertRing::set_record_geometry(uint32_t hidden, uint32_t intermediate) {
  if (record_layout(QuantType::Q4_G32, ScaleDtype::F16, hidden, intermediate).record_bytes > slot_bytes_)
    throw std::invalid_argument("ExpertRing::set_record_geometry: a Q4_G32 record of it does not fit a slot");
  hidden_ = hidden, intermediate_ = intermediate;
}

void ExpertRing::submit(uint64_t i, uint64_t offset, uint64_t length, uint32_t crc, bool background,
                        uint32_t stored) {
  if (i >= n_slots_ || length > slot_bytes_) throw std::out_of_range("ExpertRing::submit: slot or length out of range");
  if (stored != 0 && (hidden_ == 0 || (stored != static_cast<uint32_t>(QuantType::Q3_G32) &&
                                       stored != static_cast<uint32_t>(QuantType::Q2_G32))))
    throw std::invalid_argument("ExpertRing::submit: only Q3_G32 and Q2_G32 records widen, after set_record_geometry");
  if (stop_) throw std::logic_error("ExpertRing::submit: the ring is shut down");
  const SlotState s = state(i);
  if (s == SlotState::Loading || s == SlotState::InUse)
    throw std::logic_error("ExpertRing::submit: slot " + std::to_string(i) + " is busy");
  set_state(i, SlotState::Loading);
  {
    std::lock_guard<std::mutex> lock(mu_);
    latest_[i] = {i, offset, length, crc, latest_[i].generation + 1, stored};
    taken_[i] = false;
    (background ? background_ : demand_).push(latest_[i]);
    if (!background) demand_generation_[i] = latest_[i].generation;
  }
  work_cv_.notify_one();
}

bool ExpertRing::expedite(uint64_t i) {
  if (i >= n_slots_) throw std::out_of_range("ExpertRing::expedite: slot out of range");
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Taken (being read or done) or already queued as demand: nothing to do. So a slot has at most one
    // live request in each queue (the background queue has room for a stale one per slot besides).
    if (taken_[i] || state(i) != SlotState::Loading || demand_generation_[i] == latest_[i].generation)
      return false;
    demand_.push(latest_[i]);
    demand_generation_[i] = latest_[i].generation;
  }
  work_cv_.notify_one();
  return true;
}

bool ExpertRing::cancel(uint64_t i) {
  if (i >= n_slots_) throw std::out_of_range("ExpertRing::cancel: slot out of range");
  std::lock_guard<std::mutex> lock(mu_);
  if (taken_[i] || state(i) != SlotState::Loading || demand_generation_[i] == latest_[i].generation) return false;
  ++latest_[i].generation;  // its queued request is stale now: a worker that pops it skips it
  set_state(i, SlotState::Empty);
  return true;
}

void ExpertRing::discard(uint64_t i) {
  if (i >= n_slots_) throw std::out_of_range("ExpertRing::discard: slot out of range");
  const SlotState s = state(i);
  if (s == SlotState::Loading || s == SlotState::InUse)
    throw std::logic_error("ExpertRing::discard: slot " + std::to_string(i) + " is busy");
  set_state(i, SlotState::Empty);
#ifdef MADV_DONTNEED
  // Linux frees a private anonymous page at once; elsewhere the pages may linger until the system wants them.
  madvise(slot(i), slot_bytes_, MADV_DONTNEED);
#endif
}

bool ExpertRing::pread_record(const Request& r, ReadFailure& f, uint8_t* dst) {
  {
    std::lock_guard<std::mutex> lock(busy_mu_);
    if (reading_++ == 0) busy_since_ = std::chrono::steady_clock::now();
  }
  struct Done {  // the read's end, however it ends, closes the busy stretch if it was the last
    ExpertRing* ring;
    ~Done() {
      std::lock_guard<std::mutex> lock(ring->busy_mu_);
      if (--ring->reading_ == 0) ring->busy_ += std::chrono::steady_clock::now() - ring->busy_since_;
    }
  } done{this};
  while (f.done < r.length) {
    const bool use_direct = direct_fd_ >= 0 && !fell_back_.load(std::memory_order_relaxed);
    const ssize_t got = pread(use_direct ? direct_fd_ : buffered_fd_, dst + f.done, r.length - f.done,
                              static_cast<off_t>(r.offset + f.done));
    if (got < 0) {
      if (errno == EINTR) continue;
      if (errno == EINVAL && use_direct) {  // the filesystem accepted O_DIRECT at open but refuses the read
        fell_back_.store(true);
        continue;
      }
      f.error = errno;
      return false;
    }
    if (got == 0) return false;  // end of file: the vault is shorter than its index says
    f.done += static_cast<uint64_t>(got);
  }
  return true;
}

bool ExpertRing::read_all(const Request& r, ReadFailure& f) {
  f = {0, false, r.offset, 0, r.length};
  uint8_t* dst = slot(r.slot);
  if (faults_left_.load(std::memory_order_relaxed) > 0 && faults_left_.fetch_sub(1) > 0) {  // inject_faults
    if (fault_errno_.load() != 0) {
      f.error = fault_errno_.load();
      return false;
    }
    const ssize_t got = pread(buffered_fd_, dst, r.length / 2, static_cast<off_t>(r.offset));
    f.done = got > 0 ? static_cast<uint64_t>(got) : 0;
    return false;  // as if the file ended there
  }
  if (!pread_record(r, f, dst)) return false;
  if (!intact(r, dst)) {
    f.bad_crc = true;
    return false;
  }
  if (r.stored != 0) widen_record(dst, QuantType(r.stored), hidden_, intermediate_);
  return true;
}

bool ExpertRing::intact(const Request& r, const uint8_t* bytes) {
  if (!verify_) return true;
  const std::pair<uint64_t, uint32_t> as_indexed{r.length, r.crc};
  {
    std::lock_guard<std::mutex> lock(checked_mu_);
    const auto it = checked_.find(r.offset);
    if (it != checked_.end() && it->second == as_indexed) return true;
  }
  if (crc32(0, bytes, r.length) != r.crc) return false;
  std::lock_guard<std::mutex> lock(checked_mu_);
  checked_[r.offset] = as_indexed;
  return true;
}

void ExpertRing::worker() {
  for (;;) {
    Request r;
    bool background = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [this] {
        return stop_ || demand_.count > 0 ||
               (background_.count > 0 && demand_active_ == 0 && background_active_ == 0);
      });
      if (stop_) return;
      background = demand_.count == 0;
      r = background ? background_.pop() : demand_.pop();
      if (taken_[r.slot] || r.generation != latest_[r.slot].generation) continue;  // read already, or stale
      taken_[r.slot] = true;
      ++(background ? background_active_ : demand_active_);
    }
    const bool ok = read_all(r, failures_[r.slot]);
    if (ok) bytes_read_.fetch_add(r.length);
    set_state(r.slot, !ok ? SlotState::Failed : background ? SlotState::Ready : SlotState::InUse);
    {
      std::lock_guard<std::mutex> lock(mu_);
      epoch_.fetch_add(1, std::memory_order_acq_rel);
      --(background ? background_active_ : demand_active_);
    }
    work_cv_.notify_one();  // a background read may start now
    done_cv_.notify_all();
  }
}

double ExpertRing::busy_seconds() const {
  std::lock_guard<std::mutex> lock(busy_mu_);
  auto busy = busy_;
  if (reading_ > 0) busy += std::chrono::steady_clock::now() - busy_since_;
  return std::chrono::duration<double>(busy).count();
}

SlotState ExpertRing::wait(uint64_t i) const {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return stop_ || state(i) != SlotState::Loading; });
  return state(i);
}

RecordStatus ExpertRing::status(int64_t i) const {
  switch (state(static_cast<uint64_t>(i))) {
    case SlotState::Loading: return RecordStatus::Pending;
    case SlotState::Failed: return RecordStatus::Failed;
    case SlotState::Empty: return RecordStatus::Failed;  // nothing was asked for: never compute on it
    default: return RecordStatus::Ready;
  }
}

void ExpertRing::wait_past(uint64_t e) const {
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return stop_ || epoch_.load(std::memory_order_acquire) != e; });
}

}  // namespace mosaic
