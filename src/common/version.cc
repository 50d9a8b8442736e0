#include "rd2h/version.h"

namespace rd2h {

const char* version() {
  return RD2H_VERSION;
}

}  // namespace rd2h
