// rd2h's log: leveled lines on stderr ("[time] [rd2h] [level] message"). Everything the
// library reports on its own (a refused peer, a failed post, a fallback) goes here, never
// straight to stderr, so a host sets one level for all of it.
#pragma once

#include <string_view>

#include "rd2h/common/status.h"

namespace rd2h {

// trace, debug, info, warn, error, critical or off. The level starts as $RD2H_LOG_LEVEL
// if that names one, else info.
Status set_log_level(std::string_view level);

}  // namespace rd2h
