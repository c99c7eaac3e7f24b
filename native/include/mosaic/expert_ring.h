// The expert ring: slots allocated once (page-aligned, one whole record each), an atomic state per slot,
// and background I/O threads that read records into slots and check their CRC-32 (at a record's first read:
// see `verify`) before marking them usable. Which record lives in which slot is decided by the caller (the
// store's policy); the ring only moves bytes and publishes states.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mosaic/kernels.h"

namespace mosaic {

enum class SlotState : int32_t { Empty = 0, Loading = 1, Ready = 2, InUse = 3, Failed = 4 };

// Why a read failed, kept per slot until the slot is next submitted.
struct ReadFailure {
  int32_t error = 0;      // errno of the failed pread, or 0
  bool bad_crc = false;   // the bytes arrived but their CRC-32 does not match the index
  uint64_t offset = 0;    // file offset of the record
  uint64_t done = 0;      // bytes read before the failure
  uint64_t length = 0;    // bytes requested
};

class ExpertRing final : public Arrivals {
 public:
  // direct_fd: the vault opened with O_DIRECT (or F_NOCACHE), or -1; buffered_fd: opened plainly, used when
  // direct_fd is -1 and as the fallback when a Direct-I/O read is refused (EINVAL). The ring owns both.
  // verify: check a record's CRC-32 the first time this ring reads it, and trust later reads of the same
  // record (offset, length and CRC-32 as the index gives them), whose bytes on disk were shown intact. A
  // model larger than its ring re-reads each record many times; checking every read took CPU time its
  // decode needed. false: never check (a probe of the disk's own speed).
  ExpertRing(int direct_fd, int buffered_fd, uint64_t n_slots, uint64_t slot_bytes, int io_threads,
             bool verify = true);
  ~ExpertRing() override;
  ExpertRing(const ExpertRing&) = delete;
  ExpertRing& operator=(const ExpertRing&) = delete;

  // Stop the I/O threads (after the read in progress) and close the files; the memory stays until
  // destruction, so views of it stay valid.
  void shutdown();

  uint64_t n_slots() const { return n_slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint8_t* slot(uint64_t i) const { return memory_ + i * slot_bytes_; }
  uint8_t* memory() const { return memory_; }

  SlotState state(uint64_t i) const { return SlotState(states_[i].load(std::memory_order_acquire)); }
  void set_state(uint64_t i, SlotState s) { states_[i].store(static_cast<int32_t>(s), std::memory_order_release); }

  // Queue a read of [offset, offset + length) into slot i; the slot becomes Loading, then InUse (or Failed).
  // At most one read per slot is outstanding, so each queue (n_slots entries) never grows.
  // A background read (a fill of the ring ahead of need) starts only while no demand read is queued or in
  // progress, one at a time, and leaves the slot Ready, not InUse: it never delays a layer by more than
  // the one read it may have in flight.
  // stored: the record's type when it is a low-bit one (Q3_G32, Q2_G32) that the I/O thread widens to
  // Q4_G32 in the slot after its CRC-32 checks (set_record_geometry first), else 0.
  void submit(uint64_t i, uint64_t offset, uint64_t length, uint32_t crc, bool background = false,
              uint32_t stored = 0);
  // The experts' geometry, which widening needs; the slots must hold a Q4_G32 record of it.
  void set_record_geometry(uint32_t hidden, uint32_t intermediate);
  // A layer needs slot i's background read now: if it has not started, it joins the demand reads (its
  // place in the background queue is then skipped). Returns whether it did.
  bool expedite(uint64_t i);
  // Memory pressure: drop slot i's background read if no worker has taken it (the slot is then Empty), and
  // return whether it did; give slot i's pages back to the system (it must hold no read in progress or
  // record in use). Its bytes read as zeros afterwards, until a read fills it again.
  bool cancel(uint64_t i);
  void discard(uint64_t i);
  SlotState wait(uint64_t i) const;  // block while slot i is Loading
  ReadFailure failure(uint64_t i) const { return failures_[i]; }

  bool direct() const { return direct_fd_ >= 0 && !fell_back_.load(); }
  bool fell_back() const { return fell_back_.load(); }  // a Direct-I/O read was refused; buffered since
  // Fault injection for tests (no failing device can be made where they run): the next `count` reads
  // fail with `error` (an errno), or with error 0 come back short (half the record, then end of file).
  void inject_faults(int count, int error) {
    fault_errno_.store(error);
    faults_left_.store(count);
  }
  uint64_t bytes_read() const { return bytes_read_.load(); }
  // Seconds during which at least one read was in progress (the device busy on the ring's behalf), up to now.
  double busy_seconds() const;

  // Arrivals, for the MoE driver: which slots hold usable records, and a way to sleep until one more does.
  uint64_t epoch() const override { return epoch_.load(std::memory_order_acquire); }
  RecordStatus status(int64_t i) const override;
  void wait_past(uint64_t epoch) const override;

 private:
  struct Request { uint64_t slot, offset, length; uint32_t crc; uint64_t generation; uint32_t stored; };
  struct Queue {  // circular, n_slots entries, allocated once
    std::vector<Request> items;
    uint64_t head = 0, count = 0;
    void push(const Request& r) { items[(head + count++) % items.size()] = r; }
    Request pop() {
      const Request r = items[head];
      head = (head + 1) % items.size();
      --count;
      return r;
    }
  };
  void worker();
  bool read_all(const Request& r, ReadFailure& f);  // read, check the CRC-32 (if not yet checked), widen
  bool intact(const Request& r, const uint8_t* bytes);  // the CRC-32 matches, or matched at an earlier read
  bool pread_record(const Request& r, ReadFailure& f, uint8_t* dst);  // the bytes alone, timed as busy

  int direct_fd_, buffered_fd_;
  uint64_t n_slots_, slot_bytes_;
  uint32_t hidden_ = 0, intermediate_ = 0;  // set_record_geometry: what a widened record is
  uint8_t* memory_ = nullptr;
  std::unique_ptr<std::atomic<int32_t>[]> states_;
  std::unique_ptr<ReadFailure[]> failures_;
  Queue demand_, background_;
  // Per slot, under mu_: the latest request (a request of an older generation is stale), whether a
  // worker has taken it, so a request queued twice (expedite) is read once, and the generation last put
  // in the demand queue, so it is put there once.
  std::vector<Request> latest_;
  std::vector<bool> taken_;
  std::vector<uint64_t> demand_generation_;
  int demand_active_ = 0, background_active_ = 0;
  bool stop_ = false;
  std::atomic<bool> fell_back_{false};
  std::atomic<int> faults_left_{0}, fault_errno_{0};
  std::atomic<uint64_t> bytes_read_{0};
  // verify: records whose CRC-32 matched, by offset, with the length and CRC-32 they were checked against
  const bool verify_;
  std::mutex checked_mu_;
  std::unordered_map<uint64_t, std::pair<uint64_t, uint32_t>> checked_;
  // busy_seconds: reads in progress, when the latest stretch of busy time began, and the closed stretches
  mutable std::mutex busy_mu_;
  int reading_ = 0;
  std::chrono::steady_clock::time_point busy_since_;
  std::chrono::steady_clock::duration busy_{};
  std::atomic<uint64_t> epoch_{0};
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  mutable std::condition_variable done_cv_;
  std::vector<std::thread> threads_;
};

}  // namespace mosaic
