#include "common/service/server_main.h"

#include <pthread.h>

#include "absl/synchronization/mutex.h"

namespace specserve {
namespace {

pthread_t g_signal_thread;

// Runs only in a thread that does not block the stop signals: one started
// before BlockStopSignals (OpenBLAS starts its pool when it is loaded, and
// MaybeReexecForAvx512 loads it first thing in main). Without it the
// default action would kill the process there, skipping the graceful
// shutdown. pthread_kill is async-signal-safe.
void ForwardStopSignal(int sig) { pthread_kill(g_signal_thread, sig); }

}  // namespace

void InitServerProcess() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

sigset_t BlockStopSignals() {
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  g_signal_thread = pthread_self();
  struct sigaction forward = {};
  forward.sa_handler = ForwardStopSignal;
  sigemptyset(&forward.sa_mask);
  forward.sa_flags = SA_RESTART;
  sigaction(SIGINT, &forward, nullptr);
  sigaction(SIGTERM, &forward, nullptr);
  return stop;
}

}  // namespace specserve
